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
	// observers[scopeIndex][failed]
	observers [3][2]prometheus.Observer
}

type allocationMetricsOut struct {
	cell.Out
	Metrics   *allocationMetrics
	Collector prometheus.Collector `group:"identityd-metrics"`
}

// metricScopes are the scopes with an allocation histogram, in the order
// of scopeIndex.
var metricScopes = [3]identity.Scope{identity.ScopeGlobal, identity.ScopeLocal, identity.ScopeRemoteNode}

func scopeIndex(s identity.Scope) int {
	switch s {
	case identity.ScopeLocal:
		return 1
	case identity.ScopeRemoteNode:
		return 2
	}
	return 0
}

func newAllocationMetrics() allocationMetricsOut {
	m := &allocationMetrics{duration: metrics.NewIdentityAllocationDuration()}
	for i, s := range metricScopes {
		m.observers[i] = [2]prometheus.Observer{
			m.duration.WithLabelValues(s.String(), metrics.OutcomeSuccess),
			m.duration.WithLabelValues(s.String(), metrics.OutcomeFailure),
		}
	}
	return allocationMetricsOut{Metrics: m, Collector: m.duration}
}

// clockBase anchors monotonicNow.
var clockBase = time.Now()

// monotonicNow reads the monotonic clock only: half the cost of time.Now,
// which reads the wall clock too, on a path that takes a few hundred
// nanoseconds in all.
func monotonicNow() time.Duration { return time.Since(clockBase) }

func (m *allocationMetrics) observe(scope identity.Scope, err error, d time.Duration) {
	if m == nil {
		return
	}
	failed := 0
	if err != nil {
		failed = 1
	}
	m.observers[scopeIndex(scope)][failed].Observe(d.Seconds())
}
