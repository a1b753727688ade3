package allocatortest

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/identityd/identityd/internal/testproc"
	"github.com/identityd/identityd/labels"
)

// Churn is the workload of a store's TestChurnLevelsOff: every node
// allocates the same Rate new label sets a second, each held Hold, for
// Duration, while the store's collector runs every Interval at Limit
// deletions a minute.
type Churn struct {
	Duration, Interval, Hold time.Duration
	Rate, Limit              int
	// HeartbeatTimeout is the CRD store's --identity-heartbeat-timeout.
	HeartbeatTimeout time.Duration
	// Life, when set, makes the run a short one, checked by its level
	// instead of its growth over 100 s: at the end, at most the new
	// label sets the run delivered in Life (the longest an identity
	// should stay: the hold, the collector's intervals and grace, and
	// room for a loaded machine), sampled every second.
	Life time.Duration
}

// ChurnFromEnv reads the churn of the environment: IDENTITYD_CHURN_SECONDS
// (no default: without it the test is skipped; 300 for the full run),
// IDENTITYD_CHURN_RATE (40), IDENTITYD_CHURN_GC_INTERVAL in seconds (10),
// IDENTITYD_CHURN_GC_LIMIT (2500) and, for the CRD store,
// IDENTITYD_CHURN_HEARTBEAT_TIMEOUT in seconds (120, the shortest); each
// set is held 10 s.
func ChurnFromEnv(t *testing.T) Churn {
	t.Helper()
	secs := testproc.CountFromEnv(t, "IDENTITYD_CHURN_SECONDS", 0, 0)
	if secs == 0 {
		t.Skip("IDENTITYD_CHURN_SECONDS=300 runs it")
	}
	return Churn{
		Duration:         time.Duration(secs) * time.Second,
		Rate:             testproc.CountFromEnv(t, "IDENTITYD_CHURN_RATE", 40, 1),
		Interval:         time.Duration(testproc.CountFromEnv(t, "IDENTITYD_CHURN_GC_INTERVAL", 10, 1)) * time.Second,
		Limit:            testproc.CountFromEnv(t, "IDENTITYD_CHURN_GC_LIMIT", 2500, 1),
		Hold:             10 * time.Second,
		HeartbeatTimeout: time.Duration(testproc.CountFromEnv(t, "IDENTITYD_CHURN_HEARTBEAT_TIMEOUT", 120, 1)) * time.Second,
	}
}

// ChurnNode allocates a label set on one node and returns how to release
// it.
type ChurnNode func(ctx context.Context, lbls labels.Labels) (release func(), err error)

// RunChurn runs c on the nodes, logs the store's identities and the
// collector's deletions every 5 s (count reads them), and fails t unless,
// over the last 100 s, the identities grow less than 1/s and the collector
// deleted at least 95% of the new label sets the run delivered.
func RunChurn(t *testing.T, c Churn, nodes []ChurnNode, count func() (identities, deleted int)) {
	t.Helper()
	start := time.Now()
	ctx, cancel := context.WithDeadline(t.Context(), start.Add(c.Duration))
	defer cancel()
	var wg sync.WaitGroup
	var failed, newSets atomic.Int64
	for n, allocate := range nodes {
		type held struct {
			release func()
			until   time.Time
		}
		queue := make(chan held, c.Rate*int(c.Hold/time.Second)*4)
		wg.Add(2)
		go func() {
			defer wg.Done()
			for h := range queue {
				select {
				case <-time.After(time.Until(h.until)):
				case <-ctx.Done():
				}
				h.release()
			}
		}()
		go func() {
			defer wg.Done()
			var inflight sync.WaitGroup
			defer func() { inflight.Wait(); close(queue) }()
			sem := make(chan struct{}, 16)
			tick := time.NewTicker(time.Second / time.Duration(c.Rate))
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
					release, err := allocate(ctx, labels.MustParse(fmt.Sprintf("k8s:app=churn-%d", i)))
					if err != nil {
						if ctx.Err() == nil && failed.Add(1) <= 5 {
							t.Logf("node %d: allocation failed: %v", n, err)
						}
						return
					}
					if n == 0 {
						newSets.Add(1)
					}
					queue <- held{release, time.Now().Add(c.Hold)}
				}()
			}
		}()
	}

	type sample struct {
		at                     time.Duration
		objects, deleted, sets int
	}
	var samples []sample
	every := 5 * time.Second
	if c.Life > 0 {
		every = time.Second
	}
	for tick := time.NewTicker(every); ctx.Err() == nil; {
		select {
		case <-tick.C:
			objects, deleted := count()
			s := sample{time.Since(start), objects, deleted, int(newSets.Load())}
			samples = append(samples, s)
			t.Logf("%4.0fs  identities %6d  deleted %6d  failed %d", s.at.Seconds(), s.objects, s.deleted, failed.Load())
		case <-ctx.Done():
			tick.Stop()
		}
	}
	wg.Wait()
	if failed.Load() > 0 {
		t.Errorf("%d allocations failed", failed.Load())
	}
	if c.Life > 0 {
		checkLevel(t, c, samples[len(samples)/2].at, samples[len(samples)/2].sets, samples[len(samples)-1].at, samples[len(samples)-1].sets, samples[len(samples)-1].objects)
		return
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
	t.Logf("over the last %.0f s: identities %+.2f/s, deleted %.1f/s, level %d, new sets %.1f/s (asked %d/s)", span, growth, deletes, last.objects, churn, c.Rate)
	// A churn that a loaded machine delivers unevenly moves the level
	// with it; the age of what the collector deletes does not, while it
	// keeps up.
	lag := func(s sample) float64 {
		for i := 1; i < len(samples); i++ {
			a, b := samples[i-1], samples[i]
			if b.sets >= s.deleted && b.sets > a.sets {
				at := a.at + time.Duration(float64(b.at-a.at)*float64(s.deleted-a.sets)/float64(b.sets-a.sets))
				return (s.at - at).Seconds()
			}
		}
		return 0
	}
	t.Logf("the collector deleted what the run had created %.0f s before at %.0f s, %.0f s before at %.0f s", lag(first), first.at.Seconds(), lag(last), last.at.Seconds())
	if growth >= 1 || deletes < 0.95*churn {
		t.Fatalf("over the last %.0f s: identities %+.2f/s, deleted %.1f/s; want under +1/s and at least 95%% of the %.1f new sets/s", span, growth, deletes, churn)
	}
}

// checkLevel fails t unless the identities at the end of a short run are
// at most the new label sets delivered in c.Life, at the rate the run
// delivered over its second half (from, fromSets to at, sets).
func checkLevel(t *testing.T, c Churn, from time.Duration, fromSets int, at time.Duration, sets, objects int) {
	t.Helper()
	churn := float64(sets-fromSets) / (at - from).Seconds()
	bound := churn * c.Life.Seconds()
	t.Logf("at %.0f s: %d identities, new sets %.1f/s (asked %d/s) over the second half; at most %.0f (%s of them)", at.Seconds(), objects, churn, c.Rate, bound, c.Life)
	if churn < 1 {
		t.Fatalf("the run delivered %.1f new label sets a second over its second half: too few to check", churn)
	}
	if float64(objects) > bound {
		t.Fatalf("%d identities at the end, more than the %.0f new label sets of %s at %.1f/s: the collector falls behind", objects, bound, c.Life, churn)
	}
}
