package etcdstore

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/identityd/identityd/cells/metrics"
)

// gcStatusSkipped is the value of the status label of
// identityd_identity_gc_entries that only identityd has: unreferenced master
// keys whose delete transaction found them referenced (or changed) again,
// and so kept them.
const gcStatusSkipped = "skipped"

// newStoreMetrics contributes the collector of the store's garbage
// collection and node checks, when the hive has the store (none without a
// kvstore, or in crd mode).
func newStoreMetrics(s *Store) metrics.CollectorOut {
	if s == nil {
		return metrics.CollectorOut{}
	}
	return metrics.NewCollector(newStoreCollector(s))
}

// storeCollector reports the garbage collection of global identities and
// what the checks of this node's keys found, read from the store's
// counters at scrape time.
//
// The store keeps running totals, not the result of each GC run, so
// identityd_identity_gc_entries counts master keys since the agent started
// rather than those of the last run as Cilium's does, and has no "alive"
// series (the GC never counts the keys it keeps; a key in use is not a
// candidate). The GC names and gauge types are Cilium's so that its
// dashboards find the series.
type storeCollector struct {
	store *Store

	gcEntries, gcRuns            *prometheus.Desc
	conflicts, rewritten, splits *prometheus.Desc
}

func newStoreCollector(s *Store) *storeCollector {
	ns := metrics.Namespace
	return &storeCollector{
		store: s,
		gcEntries: prometheus.NewDesc(ns+"_identity_gc_entries",
			"Number of global identities the garbage collection deleted, or skipped because they were referenced again, since the agent started, by status",
			[]string{metrics.LabelStatus}, nil),
		gcRuns: prometheus.NewDesc(ns+"_identity_gc_runs",
			"Number of identity garbage collection runs since the agent started, by outcome (a run in progress counts as success)",
			[]string{metrics.LabelOutcome}, nil),
		conflicts: prometheus.NewDesc(ns+"_kvstore_node_name_conflicts_total",
			"Number of checks that found this node's name used in etcd by another writer (another agent's node key, or a reference key on another lease)",
			nil, nil),
		rewritten: prometheus.NewDesc(ns+"_kvstore_references_rewritten_total",
			"Number of this node's identity reference keys found missing or changed in etcd and written again",
			nil, nil),
		splits: prometheus.NewDesc(ns+"_kvstore_split_label_sets_total",
			"Number of times a reference of this node was not written again because other nodes reference its global label set under another ID",
			nil, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *storeCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.gcEntries, c.gcRuns, c.conflicts, c.rewritten, c.splits} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *storeCollector) Collect(ch chan<- prometheus.Metric) {
	gc, node := &c.store.gc, &c.store.nodeStats
	gauge := func(d *prometheus.Desc, v uint64, label string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, float64(v), label)
	}
	gauge(c.gcEntries, gc.deleted.Load(), metrics.GCStatusDeleted)
	gauge(c.gcEntries, gc.skipped.Load(), gcStatusSkipped)
	// A run counts in runs when it begins and in failed when it ends in
	// an error: failed is read first, so that the difference is never
	// negative.
	failed := gc.failed.Load()
	gauge(c.gcRuns, gc.runs.Load()-failed, metrics.OutcomeSuccess)
	gauge(c.gcRuns, failed, metrics.OutcomeFailure)
	counter := func(d *prometheus.Desc, v uint64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v))
	}
	counter(c.conflicts, node.conflicts.Load())
	counter(c.rewritten, node.rewritten.Load())
	counter(c.splits, node.splits.Load())
}
