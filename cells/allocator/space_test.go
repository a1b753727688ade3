package allocator

import (
	"math"
	"testing"
	"time"

	"github.com/cilium/hive/hivetest"

	"github.com/identityd/identityd/identity"
)

// TestSpaceForecast: the forecast of the range's exhaustion divides the
// free IDs by the net creation rate of the last five minutes: created
// minus deleted. Without the forecast the metric does not exist (checked
// in TestSpaceExhaustedEtcd's scrape).
func TestSpaceForecast(t *testing.T) {
	cluster := identity.ClusterInfo{Name: "default"}
	w := newSpaceWatch(cluster, hivetest.Logger(t), nil)
	now := time.Date(2026, 12, 2, 1, 0, 0, 0, time.UTC)
	w.now = func() time.Time { return now }
	if f := w.forecast(); !math.IsInf(f, 1) {
		t.Fatalf("forecast without changes: %v, want +Inf", f)
	}
	next := cluster.MinID()
	// Two new identities a second for ten minutes, one deleted a second.
	for range 600 {
		now = now.Add(time.Second)
		w.set(next, true)
		w.set(next+1, true)
		w.set(next, false)
		next += 2
	}
	free := float64(int(cluster.MaxID()-cluster.MinID()) + 1 - 600)
	if f, want := w.forecast(), free/1.0; math.Abs(f-want) > want/100 {
		t.Fatalf("forecast at a net growth of 1/s: %.0f s, want %.0f s", f, want)
	}
	// As many deleted as created for five minutes: not growing.
	for range 300 {
		now = now.Add(time.Second)
		w.set(next, true)
		w.set(next-1, false)
		next++
	}
	if f := w.forecast(); !math.IsInf(f, 1) {
		t.Fatalf("forecast at a net growth of 0: %v, want +Inf", f)
	}
	if len(w.samples) > 302 {
		t.Fatalf("%d samples kept for a five-minute window of one change a second", len(w.samples))
	}
}
