package doublewrite

import (
	"errors"
	"fmt"
	"testing"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/eventually"
	"github.com/identityd/identityd/labels"
)

// TestAdoptMirrors: in a double-write mode an adoption of a label set that
// neither store holds fails with ErrNoIdentity and writes nothing to
// either store; once another node created it, the adoption takes its ID in
// the read store and writes the node's use to the write-only store too.
// Without the mirror in Adopt the etcd reference of the second node, in
// doublewrite-readcrd, is missing (checked).
func TestAdoptMirrors(t *testing.T) {
	// One etcd and one API server for both modes, each with nodes and a
	// label set of its own.
	e := newEnv(t)
	for i, mode := range []identity.AllocationMode{identity.AllocationModeDoubleWriteReadKVStore, identity.AllocationModeDoubleWriteReadCRD} {
		t.Run(string(mode), func(t *testing.T) {
			a := e.startNode(t, fmt.Sprintf("node-a%d", i), mode, nil)
			b := e.startNode(t, fmt.Sprintf("node-b%d", i), mode, nil)
			web := labels.MustParse(fmt.Sprintf("k8s:app=adopted-%d", i))
			if id, _, err := b.a.Allocate(t.Context(), web, allocator.AdoptOnly()); !errors.Is(err, globalstore.ErrNoIdentity) {
				t.Fatalf("adopting a label set nobody created: %v, %v, want ErrNoIdentity", id, err)
			}
			created, _, err := a.a.Allocate(t.Context(), web)
			if err != nil {
				t.Fatal(err)
			}
			eventually.True(t, "node-b's read store shows the identity", func() bool {
				_, ok := b.dw.LookupByLabels(web)
				return ok
			})
			got, allocated, err := b.a.Allocate(t.Context(), web, allocator.AdoptOnly())
			if err != nil || got.ID != created.ID || allocated {
				t.Fatalf("adopting node-a's %d: %v (created %v), %v", created.ID, got, allocated, err)
			}
			eventually.True(t, "both stores record node-b's use", func() bool {
				return e.reference(t, web, fmt.Sprintf("node-b%d", i)) == created.ID.String() && e.objectLabels(t, created.ID) == web.Canonical()
			})
		})
	}
}
