package etcdstore

import (
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

// newStoreCollector reports the garbage collection of global identities
// and what the checks of this node's keys found, read from the store's
// counters at scrape time.
//
// The store keeps running totals, not the result of each GC run, so
// identityd_identity_gc_entries counts master keys since the agent started
// rather than those of the last run as Cilium's does, and has no "alive"
// series (the GC never counts the keys it keeps; a key in use is not a
// candidate). The GC names and gauge types are Cilium's so that its
// dashboards find the series.
func newStoreCollector(s *Store) *metrics.ScrapeCollector {
	var (
		gcEntries = metrics.NewDesc("identity_gc_entries",
			"Number of global identities the garbage collection deleted, or skipped because they were referenced again, since the agent started, by status",
			metrics.LabelStatus)
		gcRuns = metrics.NewDesc("identity_gc_runs",
			"Number of identity garbage collection runs since the agent started, by outcome (a run in progress counts as success)",
			metrics.LabelOutcome)
		gcLeader = metrics.NewDesc("identity_gc_leader",
			"1 while this node is the elected collector of unused global identities (one node of the cluster collects), else 0")
		conflicts = metrics.NewDesc("kvstore_node_name_conflicts_total",
			"Number of checks that found this node's name used in etcd by another writer (another agent's node key, or a reference key on another lease)")
		rewritten = metrics.NewDesc("kvstore_references_rewritten_total",
			"Number of this node's identity reference keys found missing or changed in etcd and written again")
		splits = metrics.NewDesc("kvstore_split_label_sets_total",
			"Number of times a reference of this node was not written again because other nodes reference its global label set under another ID")
		taken = metrics.NewDesc("kvstore_identities_taken_total",
			"Number of times the master key of a global identity this node uses was found holding another label set (the ID was freed while this node's keys were gone and given to another label set)")
	)
	return metrics.NewScrapeCollector(func(m metrics.Scrape) {
		gc, node := &s.gc, &s.nodeStats
		m.Gauge(gcEntries, float64(gc.deleted.Load()), metrics.GCStatusDeleted)
		m.Gauge(gcEntries, float64(gc.skipped.Load()), gcStatusSkipped)
		// A run counts in runs when it begins and in failed when it ends in
		// an error: failed is read first, so that the difference is never
		// negative.
		failed := gc.failed.Load()
		m.Gauge(gcRuns, float64(gc.runs.Load()-failed), metrics.OutcomeSuccess)
		m.Gauge(gcRuns, float64(failed), metrics.OutcomeFailure)
		leader := 0.0
		if s.Collecting() {
			leader = 1
		}
		m.Gauge(gcLeader, leader)
		m.Counter(conflicts, float64(node.conflicts.Load()))
		m.Counter(rewritten, float64(node.rewritten.Load()))
		m.Counter(splits, float64(node.splits.Load()))
		m.Counter(taken, float64(node.taken.Load()))
	}, gcEntries, gcRuns, gcLeader, conflicts, rewritten, splits, taken)
}
