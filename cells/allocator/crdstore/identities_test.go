package crdstore_test

import (
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/idprobe"
	"github.com/identityd/identityd/labels"
)

// PickIdentity decides on the objects a store's cache keeps: one whose
// name is no ID of the cluster's range, or whose security-labels do not
// parse, plays no part, however old; objects of two label sets are
// refused.
func TestPickIdentityLeavesOutWhatTheStoreIgnores(t *testing.T) {
	cluster := identity.ClusterInfo{Name: "default"}
	lbls := labels.MustParse("k8s:app=pick")
	seq := idprobe.New(lbls.Canonical(), cluster)
	old := time.Now().Add(-time.Hour).Truncate(time.Second)
	object := func(name string, created time.Time) *crdstore.CiliumIdentity {
		o := crdstore.NewIdentityObject(0, lbls)
		o.Name, o.CreationTimestamp = name, metav1.NewTime(created)
		return o
	}
	far := object(seq.Slot(1000).String(), old)
	first := object(seq.Slot(0).String(), old.Add(time.Minute))
	badName := object("0"+seq.Slot(2000).String(), old.Add(-time.Hour))
	outside := object("70000", old.Add(-time.Hour))
	badLabels := object(seq.Slot(3000).String(), old.Add(-time.Hour))
	badLabels.SecurityLabels = map[string]string{"nosource": "x"}

	got, err := crdstore.PickIdentity(cluster, []*crdstore.CiliumIdentity{badName, first, outside, badLabels, far})
	if err != nil || got != far {
		t.Errorf("picked %v (%v), want the oldest valid object %s", got, err, far.Name)
	}
	if got, err := crdstore.PickIdentity(cluster, []*crdstore.CiliumIdentity{badName, outside, badLabels}); got != nil || err != nil {
		t.Errorf("of objects the store ignores: picked %v (%v), want none", got, err)
	}
	other := crdstore.NewIdentityObject(seq.Slot(5), labels.MustParse("k8s:app=other"))
	if got, err := crdstore.PickIdentity(cluster, []*crdstore.CiliumIdentity{far, other}); err == nil {
		t.Errorf("objects of two label sets: picked %v, want an error", got)
	}
}
