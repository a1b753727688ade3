package etcdstore

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/testproc"
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

// TestChurnLevelsOff: two nodes on a real etcd allocate the same
// IDENTITYD_CHURN_RATE new label sets a second (default 40), each held
// 10 s, for IDENTITYD_CHURN_SECONDS (it runs only when that is set; 300
// for the full run), collecting every IDENTITYD_CHURN_GC_INTERVAL seconds
// (default 10) at IDENTITYD_CHURN_GC_LIMIT deletions a minute (default
// 2500): the number of identities levels off, growing less than 1/s over
// the last 100 s, and the collector deletes at least 95% of the new
// label sets the run delivered there (docs/benchmarks.md, "Identity churn").
func TestChurnLevelsOff(t *testing.T) {
	secs := testproc.CountFromEnv(t, "IDENTITYD_CHURN_SECONDS", 0, 0)
	if secs == 0 {
		t.Skip("IDENTITYD_CHURN_SECONDS=300 runs it")
	}
	rate := testproc.CountFromEnv(t, "IDENTITYD_CHURN_RATE", 40, 1)
	interval := time.Duration(testproc.CountFromEnv(t, "IDENTITYD_CHURN_GC_INTERVAL", 10, 1)) * time.Second
	limit := testproc.CountFromEnv(t, "IDENTITYD_CHURN_GC_LIMIT", 2500, 1)
	const hold = 10 * time.Second
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	gc := func(_ *kvstore.Config, e *storeConfig) {
		e.IdentityGCInterval, e.IdentityGCRateLimit, e.IdentityGCRateInterval = interval, int64(limit), time.Minute
	}
	nodes := []*etcdNode{startEtcdNode(t, c, "node-a", gc), startEtcdNode(t, c, "node-b", gc)}

	start := time.Now()
	ctx, cancel := context.WithDeadline(t.Context(), start.Add(time.Duration(secs)*time.Second))
	defer cancel()
	var wg sync.WaitGroup
	var failed, newSets atomic.Int64
	for _, n := range nodes {
		type heldID struct {
			id    *identity.Identity
			until time.Time
		}
		queue := make(chan heldID, rate*int(hold/time.Second)*4)
		wg.Add(2)
		go func() {
			defer wg.Done()
			for h := range queue {
				select {
				case <-time.After(time.Until(h.until)):
				case <-ctx.Done():
				}
				n.alloc.Release(context.Background(), h.id)
			}
		}()
		go func() {
			defer wg.Done()
			var inflight sync.WaitGroup
			defer func() { inflight.Wait(); close(queue) }()
			sem := make(chan struct{}, 16)
			tick := time.NewTicker(time.Second / time.Duration(rate))
			defer tick.Stop()
			for i := 0; ; i++ {
				select {
				case <-ctx.Done():
					return
				case <-tick.C:
				}
				select {
				case sem <- struct{}{}:
				case <-ctx.Done():
					return
				}
				inflight.Add(1)
				go func() {
					defer func() { <-sem; inflight.Done() }()
					id, _, err := n.alloc.Allocate(ctx, labels.MustParse(fmt.Sprintf("k8s:app=churn-%d", i)))
					if err != nil {
						if ctx.Err() == nil {
							failed.Add(1)
						}
						return
					}
					if n == nodes[0] {
						newSets.Add(1)
					}
					queue <- heldID{id, time.Now().Add(hold)}
				}()
			}
		}()
	}

	type sample struct {
		at                     time.Duration
		objects, deleted, sets int
	}
	count := func() sample {
		b := nodes[0].backend
		b.cacheMu.RLock()
		objects := len(b.byID)
		b.cacheMu.RUnlock()
		var deleted uint64
		for _, n := range nodes {
			deleted += n.backend.GCStats().Deleted
		}
		return sample{time.Since(start), objects, int(deleted), int(newSets.Load())}
	}
	var samples []sample
	for tick := time.NewTicker(5 * time.Second); ctx.Err() == nil; {
		select {
		case <-tick.C:
			samples = append(samples, count())
			s := samples[len(samples)-1]
			t.Logf("%4.0fs  identities %6d  deleted %6d  failed %d", s.at.Seconds(), s.objects, s.deleted, failed.Load())
		case <-ctx.Done():
			tick.Stop()
		}
	}
	wg.Wait()
	if failed.Load() > 0 {
		t.Errorf("%d allocations failed", failed.Load())
	}
	if len(samples) < 21 {
		t.Logf("the run is shorter than the 100 s window the check needs")
		return
	}
	last, first := samples[len(samples)-1], samples[len(samples)-21]
	span := (last.at - first.at).Seconds()
	growth := float64(last.objects-first.objects) / span
	deletes := float64(last.deleted-first.deleted) / span
	// The churn the machine delivered, which a loaded machine holds
	// below the rate asked for.
	churn := float64(last.sets-first.sets) / span
	t.Logf("over the last %.0f s: identities %+.2f/s, deleted %.1f/s, level %d, new sets %.1f/s (asked %d/s)", span, growth, deletes, last.objects, churn, rate)
	if growth >= 1 || deletes < 0.95*churn {
		t.Fatalf("over the last %.0f s: identities %+.2f/s, deleted %.1f/s; want under +1/s and at least 95%% of the %.1f new sets/s", span, growth, deletes, churn)
	}
}
