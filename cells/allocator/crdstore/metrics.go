package crdstore

import (
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

// newStoreCollector reads the store's counters at scrape time.
func newStoreCollector(s *Store) *metrics.ScrapeCollector {
	var (
		ignored = metrics.NewDesc("crd_ignored_objects_total",
			"Number of CiliumIdentity object versions left out of the cache: a name that is not an ID of this cluster's range, or security-labels that are not a valid label set")
		splits = metrics.NewDesc("crd_split_label_sets_total",
			"Number of times a global label set came to have more than one CiliumIdentity object")
		foreignSplits = metrics.NewDesc("crd_split_label_sets_foreign_total",
			"Number of times a global label set came to have more than one CiliumIdentity object, one of which identityd's walk did not place (a Cilium agent's, or migrated from etcd): normal beside Cilium's agents")
		splitNow = metrics.NewDesc("crd_split_label_sets",
			"Number of global label sets that have more than one CiliumIdentity object now")
		heldSplit = metrics.NewDesc("crd_split_label_sets_held",
			"Number of global label sets this node holds under another ID than the one the rule picks now (nodes that allocate them now get the other one)")
		heldSplitTotal = metrics.NewDesc("crd_split_label_sets_held_total",
			"Number of times a global label set this node holds came to have another ID picked by the rule")
		allocations = metrics.NewDesc("crd_allocations_total",
			"Number of global identity allocations by outcome: created, adopted, conflict (other writers kept winning), exhausted (the range is full), error",
			metrics.LabelOutcome)
		taken = metrics.NewDesc("crd_identities_taken_total",
			"Number of times a global identity this node uses was found with a CiliumIdentity of another label set (the ID was freed while this node's record was gone and given to another label set, or its object rewritten)")
		unmarked = metrics.NewDesc("crd_heartbeat_marks_removed_total",
			"Number of heartbeat marks this node removed from CiliumIdentity objects it uses or depends on")
		nodeWrites = metrics.NewDesc("crd_identity_node_writes_total",
			"Number of writes of this node's IdentityNode record, by outcome",
			metrics.LabelOutcome)
		nodeRecreated = metrics.NewDesc("crd_identity_node_recreated_total",
			"Number of times this node's IdentityNode record was found deleted under the running node and written again at once")
	)
	return metrics.NewScrapeCollector(func(m metrics.Scrape) {
		m.Counter(ignored, float64(s.ids.ignoredTotal.Load()))
		m.Counter(splits, float64(s.ids.splitsTotal.Load()))
		m.Counter(foreignSplits, float64(s.ids.foreignSplits.Load()))
		m.Gauge(splitNow, float64(s.ids.splitKeys.Load()))
		m.Gauge(heldSplit, float64(s.splits.held.Load()))
		m.Counter(heldSplitTotal, float64(s.splits.total.Load()))
		m.Counter(allocations, float64(s.stats.created.Load()), outcomeCreated)
		m.Counter(allocations, float64(s.stats.adopted.Load()), outcomeAdopted)
		m.Counter(allocations, float64(s.stats.conflict.Load()), outcomeConflict)
		m.Counter(allocations, float64(s.stats.exhausted.Load()), outcomeExhausted)
		m.Counter(allocations, float64(s.stats.failed.Load()), outcomeError)
		m.Counter(taken, float64(s.stats.taken.Load()))
		m.Counter(unmarked, float64(s.stats.unmarked.Load()))
		// Failures are read first so that successes are never negative.
		failed := s.writer.failures.Load()
		m.Counter(nodeWrites, float64(s.writer.writes.Load()-failed), metrics.OutcomeSuccess)
		m.Counter(nodeWrites, float64(failed), metrics.OutcomeFailure)
		m.Counter(nodeRecreated, float64(s.writer.recreated.Load()))
	}, ignored, splits, foreignSplits, splitNow, heldSplit, heldSplitTotal, allocations, taken, unmarked, nodeWrites, nodeRecreated)
}
