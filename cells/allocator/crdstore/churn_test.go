package crdstore

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/testproc"
)

// TestChurnLevelsOff: two nodes on a real API server allocate the same
// IDENTITYD_CHURN_RATE new label sets a second (default 40), each held
// 10 s, for IDENTITYD_CHURN_SECONDS (it runs only when that is set; 300
// for the full run), without Cilium agents, collecting every
// IDENTITYD_CHURN_GC_INTERVAL seconds (default 10) at
// IDENTITYD_CHURN_GC_LIMIT deletions a minute (default 2500): the number
// of identities levels off, growing less than 1/s over the last 100 s,
// and the collector deletes at least 95% of the new label sets the run
// delivered there (docs/benchmarks.md, "Identity churn").
func TestChurnLevelsOff(t *testing.T) {
	secs := testproc.CountFromEnv(t, "IDENTITYD_CHURN_SECONDS", 0, 0)
	if secs == 0 {
		t.Skip("IDENTITYD_CHURN_SECONDS=300 runs it")
	}
	rate := testproc.CountFromEnv(t, "IDENTITYD_CHURN_RATE", 40, 1)
	interval := time.Duration(testproc.CountFromEnv(t, "IDENTITYD_CHURN_GC_INTERVAL", 10, 1)) * time.Second
	limit := testproc.CountFromEnv(t, "IDENTITYD_CHURN_GC_LIMIT", 2500, 1)
	const hold = 10 * time.Second
	srv := startServer(t)
	cfg := GCConfig{Interval: interval, RateLimit: int64(limit), RateInterval: time.Minute, HeartbeatTimeout: MinHeartbeatTimeout}
	var nodes []*gcNode
	for _, name := range []string{"node-a", "node-b"} {
		n := &gcNode{Store: newGCStore(t, srv.RESTConfig(), name, cfg), refs: newTestRefs()}
		n.cfg.IdentityGCCiliumAgents = false
		ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
		if err := n.Start(ctx, nopEvents{}, n.refs); err != nil {
			t.Fatal(err)
		}
		cancel()
		t.Cleanup(func() { n.Stop(context.Background()) })
		nodes = append(nodes, n)
	}

	start := time.Now()
	ctx, cancel := context.WithDeadline(t.Context(), start.Add(time.Duration(secs)*time.Second))
	defer cancel()
	var wg sync.WaitGroup
	var failed, newSets atomic.Int64
	for _, n := range nodes {
		type heldID struct {
			id    identity.NumericIdentity
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
				if ref := n.refs.remove(h.id); ref != nil {
					n.Release(context.Background(), ref)
				}
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
					id, _, err := n.Allocate(ctx, mustLabels(t, fmt.Sprintf("k8s:app=churn-%d", i)), n.refs.record)
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
		s := nodes[0].ids
		s.mu.RLock()
		objects := len(s.byID)
		s.mu.RUnlock()
		var deleted uint64
		for _, n := range nodes {
			deleted += n.GCStats().Deleted
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
