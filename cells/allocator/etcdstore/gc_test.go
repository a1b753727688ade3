package etcdstore

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/labels"
)

// TestGCSkipsKeysNewerThanListing: master keys created between the
// collector's listing of reference keys and its choice of candidates (a
// fill while it runs) are left to the next run, not sent a delete that
// must fail: the run skips none and spends none of its rate on them, and
// the next run keeps them as referenced. Without the check of the keys'
// revision against the listing's, the run skips all ten (checked).
func TestGCSkipsKeysNewerThanListing(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	n := startEtcdNode(t, c, "node1")
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	const fresh = 10
	n.backend.gc.afterListing = func() {
		n.backend.gc.afterListing = nil
		for i := range fresh {
			id, _, err := n.alloc.Allocate(ctx, labels.MustParse(fmt.Sprintf("k8s:app=fresh-%d", i)))
			if err != nil {
				t.Error(err)
				return
			}
			// The store's cache has it once the allocation returned.
			if _, ok := n.backend.LookupByID(id.ID); !ok {
				t.Errorf("identity %d not in the store's cache after its allocation", id.ID)
			}
		}
	}
	deleted, skipped, err := n.backend.RunGC(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if deleted != 0 || skipped != 0 {
		t.Fatalf("run during the fill: %d deleted, %d skipped; want none of the new keys tried", deleted, skipped)
	}
	deleted, skipped, err = n.backend.RunGC(ctx)
	if err != nil || deleted != 0 || skipped != 0 {
		t.Fatalf("next run: %d deleted, %d skipped, %v; want the referenced keys kept without a try", deleted, skipped, err)
	}
}
