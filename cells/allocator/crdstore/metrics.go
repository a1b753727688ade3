package crdstore

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/metrics"
)

// Outcomes of an allocation, the values of the outcome label of
// identityd_crd_allocations_total.
const (
	outcomeCreated   = "created"
	outcomeAdopted   = "adopted"
	outcomeConflict  = "conflict"
	outcomeExhausted = "exhausted"
	outcomeError     = "error"
)

// newStoreMetrics contributes the store's collector, when the hive's
// backend is this store.
func newStoreMetrics(b globalstore.Backend) metrics.CollectorOut {
	s, ok := b.(*Store)
	if !ok || s == nil {
		return metrics.CollectorOut{}
	}
	return metrics.NewCollector(newStoreCollector(s))
}

// storeCollector reads the store's counters at scrape time.
type storeCollector struct {
	store *Store

	ignored, splits, splitNow, allocations, unmarked, nodeWrites *prometheus.Desc
}

func newStoreCollector(s *Store) *storeCollector {
	ns := metrics.Namespace
	return &storeCollector{
		store: s,
		ignored: prometheus.NewDesc(ns+"_crd_ignored_objects_total",
			"Number of CiliumIdentity object versions left out of the cache: a name that is not an ID of this cluster's range, or security-labels that are not a valid label set",
			nil, nil),
		splits: prometheus.NewDesc(ns+"_crd_split_label_sets_total",
			"Number of times a global label set came to have more than one CiliumIdentity object",
			nil, nil),
		splitNow: prometheus.NewDesc(ns+"_crd_split_label_sets",
			"Number of global label sets that have more than one CiliumIdentity object now",
			nil, nil),
		allocations: prometheus.NewDesc(ns+"_crd_allocations_total",
			"Number of global identity allocations by outcome: created, adopted, conflict (other writers kept winning), exhausted (the range is full), error",
			[]string{metrics.LabelOutcome}, nil),
		unmarked: prometheus.NewDesc(ns+"_crd_heartbeat_marks_removed_total",
			"Number of heartbeat marks this node removed from CiliumIdentity objects it uses or depends on",
			nil, nil),
		nodeWrites: prometheus.NewDesc(ns+"_crd_identity_node_writes_total",
			"Number of writes of this node's IdentityNode record, by outcome",
			[]string{metrics.LabelOutcome}, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *storeCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.ignored, c.splits, c.splitNow, c.allocations, c.unmarked, c.nodeWrites} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *storeCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.store
	counter := func(d *prometheus.Desc, v uint64, lv ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), lv...)
	}
	counter(c.ignored, s.ids.ignoredTotal.Load())
	counter(c.splits, s.ids.splitsTotal.Load())
	ch <- prometheus.MustNewConstMetric(c.splitNow, prometheus.GaugeValue, float64(s.ids.splitKeys.Load()))
	counter(c.allocations, s.stats.created.Load(), outcomeCreated)
	counter(c.allocations, s.stats.adopted.Load(), outcomeAdopted)
	counter(c.allocations, s.stats.conflict.Load(), outcomeConflict)
	counter(c.allocations, s.stats.exhausted.Load(), outcomeExhausted)
	counter(c.allocations, s.stats.failed.Load(), outcomeError)
	counter(c.unmarked, s.stats.unmarked.Load())
	// Failures are read first so that successes are never negative.
	failed := s.writer.failures.Load()
	counter(c.nodeWrites, s.writer.writes.Load()-failed, metrics.OutcomeSuccess)
	counter(c.nodeWrites, failed, metrics.OutcomeFailure)
}
