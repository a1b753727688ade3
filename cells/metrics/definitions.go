package metrics

import "github.com/prometheus/client_golang/prometheus"

// Namespace prefixes every identityd metric (Cilium's are "cilium_...").
const Namespace = "identityd"

// Label names shared by the metric definitions.
const (
	LabelScope   = "scope"
	LabelOutcome = "outcome"
	LabelKind    = "kind"
	LabelAction  = "action"
	LabelStatus  = "status"
	LabelResult  = "result"
	LabelError   = "error"
)

// Values of the outcome label.
const (
	OutcomeSuccess = "success"
	OutcomeFailure = "failure"
)

// Values of the result label of NewIdentityRestoration.
const (
	RestorationRestored           = "restored"
	RestorationSkipped            = "skipped"
	RestorationReleasedAfterGrace = "released_after_grace"
)

// Values of the status label of NewIdentityGCEntries (Cilium's).
const (
	GCStatusAlive   = "alive"
	GCStatusDeleted = "deleted"
)

// The constructors below return fresh, unregistered vectors: the cell that
// records a metric creates it, keeps it, and contributes it to the hive's
// registry with NewCollector. Nothing is registered globally, so two hives
// never share a series.

// NewIdentityAllocationDuration returns identityd_identity_allocation_duration_seconds{scope,outcome}:
// how long Allocate took, by scope (global, local, remote-node) and outcome.
// The buckets run from 1µs (a local refcount hit) to about 4s (an etcd
// transaction under load), since both ends matter.
func NewIdentityAllocationDuration() *prometheus.HistogramVec {
	return prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: Namespace,
		Name:      "identity_allocation_duration_seconds",
		Help:      "Duration of identity allocations, by identity scope and outcome",
		Buckets:   prometheus.ExponentialBuckets(1e-6, 4, 12),
	}, []string{LabelScope, LabelOutcome})
}

// NewKVStoreOperationsDuration returns identityd_kvstore_operations_duration_seconds{scope,kind,action,outcome},
// Cilium's kvstore latency histogram: scope is the key space (e.g.
// "identities"), kind the request (get, txn, ...), action what it did for
// the caller (allocate, release, gc, ...).
func NewKVStoreOperationsDuration() *prometheus.HistogramVec {
	return prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: Namespace,
		Name:      "kvstore_operations_duration_seconds",
		Help:      "Duration of kvstore operations, by key scope, request kind, action and outcome",
		Buckets:   prometheus.ExponentialBuckets(0.0005, 2, 14),
	}, []string{LabelScope, LabelKind, LabelAction, LabelOutcome})
}

// NewKVStoreQuorumErrors returns identityd_kvstore_quorum_errors_total{error}:
// requests that failed because etcd had no quorum or no leader.
func NewKVStoreQuorumErrors() *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace,
		Name:      "kvstore_quorum_errors_total",
		Help:      "Number of kvstore requests that failed for lack of quorum, by error",
	}, []string{LabelError})
}

// NewIdentityGCEntries returns identityd_identity_gc_entries{status}: the
// master keys the last GC run found alive or deleted. A gauge, as Cilium's,
// set at the end of each run.
func NewIdentityGCEntries() *prometheus.GaugeVec {
	return prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: Namespace,
		Name:      "identity_gc_entries",
		Help:      "Number of global identities the last garbage collection run found alive or deleted, by status",
	}, []string{LabelStatus})
}

// NewIdentityGCRuns returns identityd_identity_gc_runs{outcome}: how many
// GC runs ended with each outcome. Cilium declares it a gauge; it is kept
// one (incremented, never set) so that Cilium dashboards read it unchanged.
func NewIdentityGCRuns() *prometheus.GaugeVec {
	return prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: Namespace,
		Name:      "identity_gc_runs",
		Help:      "Number of identity garbage collection runs, by outcome",
	}, []string{LabelOutcome})
}

// NewIdentityRestoration returns identityd_identity_restoration{result}:
// what the restoration at this start did with the checkpoint's identities
// (restored, skipped, released_after_grace). A gauge because restoration
// happens once per start; the values describe that one.
func NewIdentityRestoration() *prometheus.GaugeVec {
	return prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: Namespace,
		Name:      "identity_restoration",
		Help:      "Number of checkpointed identities by what restoration did with them at this start: restored, skipped, released_after_grace",
	}, []string{LabelResult})
}

// BoolValue is the value of a gauge that says yes (1) or no (0).
func BoolValue(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
