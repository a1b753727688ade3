package crdstore

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/allocator/globalstore/storetest"
	"github.com/identityd/identityd/identity"
)

// TestRefusalFast: in a full range of the default size (65,280 IDs), a
// new label set is refused with ErrSpaceExhausted in under 10 ms, without
// a request (the store's API server address answers nothing), instead of
// after a walk past every slot. Without the check of the cache's fill the
// refusal walks all 65,280 slots and takes longer (checked).
func TestRefusalFast(t *testing.T) {
	cluster := identity.ClusterInfo{Name: "default"}
	s := newUnstartedStore(t, &rest.Config{Host: "http://127.0.0.1:1"}, cluster, "node-a")
	s.events = storetest.NewEvents()
	var objs []any
	for id := cluster.MinID(); id <= cluster.MaxID(); id++ {
		objs = append(objs, &CiliumIdentity{
			ObjectMeta:     metav1.ObjectMeta{Name: id.String(), ResourceVersion: "1"},
			SecurityLabels: map[string]string{"k8s:app": fmt.Sprintf("fill-%d", id)},
		})
	}
	if err := s.ids.Replace(objs, "1"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	refs := storetest.NewRefs()
	var slowest time.Duration
	for i := range 20 {
		start := time.Now()
		_, _, err := s.Allocate(ctx, web(100000+i), refs.Record)
		d := time.Since(start)
		if !errors.Is(err, globalstore.ErrSpaceExhausted) {
			t.Fatalf("allocation in the full range: %v, want ErrSpaceExhausted", err)
		}
		slowest = max(slowest, d)
	}
	t.Logf("slowest of 20 refusals in a full range of %d: %s", cluster.MaxID()-cluster.MinID()+1, slowest)
	if slowest > 10*time.Millisecond {
		t.Fatalf("a refusal took %s, want under 10ms", slowest)
	}
	if got := s.stats.exhausted.Load(); got != 20 {
		t.Fatalf("%d refusals counted, want 20", got)
	}
}
