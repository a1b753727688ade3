package identitymetrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/identityd/identityd/identity"
)

// Allocation records identityd_identity_allocation_duration_seconds. The
// observers are resolved once, so an observation costs no label lookup on
// the allocation path.
type Allocation struct {
	Duration *prometheus.HistogramVec
	// observers[scopeIndex][failed]
	observers [3][2]prometheus.Observer
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

// NewAllocation resolves the series of duration (labels: scope, outcome)
// of every scope and outcome, success and failure being the outcome
// label's values.
func NewAllocation(duration *prometheus.HistogramVec, success, failure string) *Allocation {
	m := &Allocation{Duration: duration}
	for i, s := range metricScopes {
		m.observers[i] = [2]prometheus.Observer{
			duration.WithLabelValues(s.String(), success),
			duration.WithLabelValues(s.String(), failure),
		}
	}
	return m
}

// Observe records one allocation of scope that took d; a nil Allocation
// records nothing.
func (m *Allocation) Observe(scope identity.Scope, err error, d time.Duration) {
	if m == nil {
		return
	}
	failed := 0
	if err != nil {
		failed = 1
	}
	m.observers[scopeIndex(scope)][failed].Observe(d.Seconds())
}
