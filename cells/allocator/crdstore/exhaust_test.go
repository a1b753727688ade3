package crdstore

import (
	"context"
	"errors"
	"fmt"
	"slices"
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
// refusal walks all 65,280 slots and takes longer (checked). The median
// of 20 refusals is checked: a loaded machine delays single ones (14 ms,
// once, beside a parallel build), a walk delays them all.
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
	var took []time.Duration
	for i := range 20 {
		start := time.Now()
		_, _, err := s.Allocate(ctx, web(100000+i), refs.Record)
		took = append(took, time.Since(start))
		if !errors.Is(err, globalstore.ErrSpaceExhausted) {
			t.Fatalf("allocation in the full range: %v, want ErrSpaceExhausted", err)
		}
	}
	slices.Sort(took)
	median := took[len(took)/2]
	t.Logf("20 refusals in a full range of %d: median %s, slowest %s", cluster.MaxID()-cluster.MinID()+1, median, took[len(took)-1])
	if median > 10*time.Millisecond {
		t.Fatalf("refusals took %s (median), want under 10ms", median)
	}
	if got := s.stats.exhausted.Load(); got != 20 {
		t.Fatalf("%d refusals counted, want 20", got)
	}
}
