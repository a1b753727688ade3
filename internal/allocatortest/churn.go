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
}

// ChurnFromEnv reads the churn of the environment: IDENTITYD_CHURN_SECONDS
// (no default: without it the test is skipped; 300 for the full run),
// IDENTITYD_CHURN_RATE (40), IDENTITYD_CHURN_GC_INTERVAL in seconds (10)
// and IDENTITYD_CHURN_GC_LIMIT (2500); each set is held 10 s.
func ChurnFromEnv(t *testing.T) Churn {
	t.Helper()
	secs := testproc.CountFromEnv(t, "IDENTITYD_CHURN_SECONDS", 0, 0)
	if secs == 0 {
		t.Skip("IDENTITYD_CHURN_SECONDS=300 runs it")
	}
	return Churn{
		Duration: time.Duration(secs) * time.Second,
		Rate:     testproc.CountFromEnv(t, "IDENTITYD_CHURN_RATE", 40, 1),
		Interval: time.Duration(testproc.CountFromEnv(t, "IDENTITYD_CHURN_GC_INTERVAL", 10, 1)) * time.Second,
		Limit:    testproc.CountFromEnv(t, "IDENTITYD_CHURN_GC_LIMIT", 2500, 1),
		Hold:     10 * time.Second,
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
						if ctx.Err() == nil {
							failed.Add(1)
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
	for tick := time.NewTicker(5 * time.Second); ctx.Err() == nil; {
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
	if growth >= 1 || deletes < 0.95*churn {
		t.Fatalf("over the last %.0f s: identities %+.2f/s, deleted %.1f/s; want under +1/s and at least 95%% of the %.1f new sets/s", span, growth, deletes, churn)
	}
}
