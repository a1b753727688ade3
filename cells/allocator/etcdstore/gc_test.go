package etcdstore

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/internal/allocatortest"
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
	res, err := n.backend.collect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if res.Deleted != 0 || res.Skipped != 0 {
		t.Fatalf("run during the fill: %d deleted, %d skipped; want none of the new keys tried", res.Deleted, res.Skipped)
	}
	res, err = n.backend.collect(ctx)
	if err != nil || res.Deleted != 0 || res.Skipped != 0 {
		t.Fatalf("next run: %d deleted, %d skipped, %v; want the referenced keys kept without a try", res.Deleted, res.Skipped, err)
	}
}

// TestChurnLevelsOff: two nodes on a real etcd allocate the same
// IDENTITYD_CHURN_RATE new label sets a second (default 40), each held
// 10 s, for IDENTITYD_CHURN_SECONDS (it runs only when that is set; 300
// for the full run), collecting every IDENTITYD_CHURN_GC_INTERVAL seconds
// (default 10) at IDENTITYD_CHURN_GC_LIMIT deletions a minute (default
// 2500): the number of identities levels off, growing less than 1/s over
// the last 100 s, and the collector deletes at least 95% of the new
// label sets the run delivered there (docs/benchmarks.md, "Identity churn").
func TestChurnLevelsOff(t *testing.T) {
	c := allocatortest.ChurnFromEnv(t)
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	gc := func(_ *kvstore.Config, e *storeConfig) {
		e.IdentityGCInterval, e.IdentityGCRateLimit, e.IdentityGCRateInterval = c.Interval, int64(c.Limit), time.Minute
	}
	nodes := []*etcdNode{startEtcdNode(t, etcd, "node-a", gc), startEtcdNode(t, etcd, "node-b", gc)}
	var churn []allocatortest.ChurnNode
	for _, n := range nodes {
		churn = append(churn, func(ctx context.Context, lbls labels.Labels) (func(), error) {
			id, _, err := n.alloc.Allocate(ctx, lbls)
			return func() { n.alloc.Release(context.Background(), id) }, err
		})
	}
	allocatortest.RunChurn(t, c, churn, func() (int, int) {
		b := nodes[0].backend
		b.cacheMu.RLock()
		objects := len(b.byID)
		b.cacheMu.RUnlock()
		var deleted uint64
		for _, n := range nodes {
			deleted += n.backend.gcStats().Deleted
		}
		return objects, int(deleted)
	})
}
