package workloads

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/identityd/identityd/cells/metrics"
)

// workloadMetrics are the cell's metrics:
//
//   - identityd_workloads_pods_without_identity: pods of this node that
//     should have an identity and hold none yet (allocation pending or
//     failing, or their namespace not seen yet);
//   - identityd_workloads_identity_wait_seconds: how long a pod waited for
//     the identity of its current labels, from the moment the node saw the
//     pod (or its new labels) to the moment it held the identity;
//   - identityd_workloads_allocation_failures_total: allocations of a
//     pod's identity that failed (each is retried with backoff);
//   - identityd_workloads_identity_not_created_total: in operator mode,
//     pods that waited longer than --identity-allocation-timeout for the
//     identity manager to create the identity of their labels.
type workloadMetrics struct {
	withoutIdentity prometheus.Gauge
	wait            prometheus.Histogram
	failures        prometheus.Counter
	notCreated      prometheus.Counter
}

func newWorkloadMetrics() *workloadMetrics {
	return &workloadMetrics{
		withoutIdentity: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: metrics.Namespace,
			Name:      "workloads_pods_without_identity",
			Help:      "Pods of this node that should have a security identity and hold none yet",
		}),
		wait: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: metrics.Namespace,
			Name:      "workloads_identity_wait_seconds",
			Help:      "Time from the node seeing a pod, or its new labels, until the pod held the identity of its labels",
			// 1ms (an identity this node holds) to about 2 min (a
			// store that is away and comes back).
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 18),
		}),
		failures: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: metrics.Namespace,
			Name:      "workloads_allocation_failures_total",
			Help:      "Allocations of a pod's security identity that failed; each is retried with backoff",
		}),
		notCreated: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: metrics.Namespace,
			Name:      "workloads_identity_not_created_total",
			Help:      "Pods that waited longer than --identity-allocation-timeout for the identity manager to create the identity of their labels (operator mode)",
		}),
	}
}

// Describe implements prometheus.Collector.
func (m *workloadMetrics) Describe(ch chan<- *prometheus.Desc) {
	m.withoutIdentity.Describe(ch)
	m.wait.Describe(ch)
	m.failures.Describe(ch)
	m.notCreated.Describe(ch)
}

// Collect implements prometheus.Collector.
func (m *workloadMetrics) Collect(ch chan<- prometheus.Metric) {
	m.withoutIdentity.Collect(ch)
	m.wait.Collect(ch)
	m.failures.Collect(ch)
	m.notCreated.Collect(ch)
}
