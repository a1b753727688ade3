package allocator

import (
	"time"

	"github.com/cilium/hive/cell"

	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/identitymetrics"
)

type allocationMetricsOut struct {
	cell.Out
	metrics.CollectorOut

	Metrics *identitymetrics.Allocation
}

func newAllocationMetrics() allocationMetricsOut {
	m := identitymetrics.NewAllocation(metrics.NewIdentityAllocationDuration(), metrics.OutcomeSuccess, metrics.OutcomeFailure)
	return allocationMetricsOut{Metrics: m, CollectorOut: metrics.NewCollector(m.Duration)}
}

// clockBase anchors monotonicNow.
var clockBase = time.Now()

// monotonicNow reads the monotonic clock only: half the cost of time.Now,
// which reads the wall clock too, on a path that takes a few hundred
// nanoseconds in all.
func monotonicNow() time.Duration { return time.Since(clockBase) }

// newIdentityMetrics contributes the identities collector
// (internal/identitymetrics), which lists the allocator at every scrape.
// cluster gives the global ID range whose use the space usage ratio reports.
func newIdentityMetrics(a Allocator, cluster identity.ClusterInfo) metrics.CollectorOut {
	ids := identitymetrics.New(metrics.Namespace, identitymetrics.Source{
		Each: func(yield func(identitymetrics.Identity)) {
			for _, e := range a.List() {
				yield(identitymetrics.Identity{ID: e.Identity.ID, Labels: e.Identity.Labels, Remote: e.Source == SourceRemote, Restored: e.Source == SourceRestored})
			}
		},
		Withheld: func() int { return len(a.Withheld()) },
	}, cluster)
	ia, ok := a.(*identityAllocator)
	if !ok || ia.space == nil {
		return metrics.NewCollector(ids)
	}
	return metrics.NewCollector(newSpaceCollector(ia.space).Include(ids))
}

// newSpaceCollector reports the refusals for want of a global ID and the
// forecast of the range's exhaustion, whatever the store.
func newSpaceCollector(w *spaceWatch) *metrics.ScrapeCollector {
	var (
		refused = metrics.NewDesc("identity_space_exhausted_total",
			"Number of global identity allocations the store refused because every ID of this cluster's range was in use")
		forecast = metrics.NewDesc("identity_space_exhaustion_forecast_seconds",
			"Seconds until every ID of this cluster's global range is in use at the net creation rate of the last 5 minutes (created minus deleted); +Inf while the number of identities does not grow, 0 once the range is full")
	)
	return metrics.NewScrapeCollector(func(m metrics.Scrape) {
		m.Counter(refused, float64(w.refusals.Load()))
		m.Gauge(forecast, w.forecast())
	}, refused, forecast)
}
