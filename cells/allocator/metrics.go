package allocator

import (
	"time"

	"github.com/cilium/hive/cell"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/identity"
)

// allocationMetrics records identityd_identity_allocation_duration_seconds.
// The observers are resolved once, so an observation costs no label lookup
// on the allocation path.
type allocationMetrics struct {
	duration *prometheus.HistogramVec
	// observers[scope][failed]
	observers map[identity.Scope][2]prometheus.Observer
}

type allocationMetricsOut struct {
	cell.Out
	Metrics   *allocationMetrics
	Collector prometheus.Collector `group:"identityd-metrics"`
}

func newAllocationMetrics() allocationMetricsOut {
	m := &allocationMetrics{
		duration:  metrics.NewIdentityAllocationDuration(),
		observers: map[identity.Scope][2]prometheus.Observer{},
	}
	for _, s := range []identity.Scope{identity.ScopeGlobal, identity.ScopeLocal, identity.ScopeRemoteNode} {
		m.observers[s] = [2]prometheus.Observer{
			m.duration.WithLabelValues(s.String(), metrics.OutcomeSuccess),
			m.duration.WithLabelValues(s.String(), metrics.OutcomeFailure),
		}
	}
	return allocationMetricsOut{Metrics: m, Collector: m.duration}
}

func (m *allocationMetrics) observe(scope identity.Scope, err error, d time.Duration) {
	if m == nil {
		return
	}
	failed := 0
	if err != nil {
		failed = 1
	}
	m.observers[scope][failed].Observe(d.Seconds())
}
