package etcdstore

import (
	"fmt"
	"testing"
	"time"

	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/labels"
)

// TestEtcdPeriodicSyncBatches: the periodic sync of a node holding 100
// references costs two transactions (a batch of 64 keys each at most) and
// no read while nothing changed, rather than one read per reference; a
// deleted reference in a batch is still found and written again.
func TestEtcdPeriodicSyncBatches(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	n := startEtcdNode(t, c, "node1")
	ctx := testCtx(t, time.Minute)
	var first labels.Labels
	for i := range 100 {
		lbls := labels.MustParse(fmt.Sprintf("k8s:app=sync-%d", i))
		if _, _, err := n.alloc.Allocate(ctx, lbls); err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			first = lbls
		}
	}
	before := n.kv.RequestCounts()
	if rewritten, err := n.backend.SyncReferences(ctx); err != nil || rewritten != 0 {
		t.Fatalf("sync: %d rewritten, %v", rewritten, err)
	}
	after := n.kv.RequestCounts()
	// The node-name check reads one key; the references cost no read.
	if txns, ranges := after["Txn"]-before["Txn"], after["Range"]-before["Range"]; txns != 2 || ranges > 1 {
		t.Errorf("a sync of 100 unchanged references sent %d transactions and %d reads, want 2 and at most 1", txns, ranges)
	}

	if _, err := cli.Delete(ctx, refKey(first, "node1")); err != nil {
		t.Fatal(err)
	}
	if rewritten, err := n.backend.SyncReferences(ctx); err != nil || rewritten != 1 {
		t.Fatalf("sync after a deleted reference: %d rewritten, %v; want 1", rewritten, err)
	}
	if _, _, ok := getValue(t, cli, refKey(first, "node1")); !ok {
		t.Error("the deleted reference was not written again")
	}
}
