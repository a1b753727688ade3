package scrape

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/cells/metrics"
)

// NodeStatser is a global backend that checks this node's keys, as
// *etcdstore.Store does.
type NodeStatser interface {
	NodeStats() etcdstore.NodeStats
}

// NodeCollector reports what the checks of this node's keys in etcd found,
// read from the backend's counters at scrape time.
type NodeCollector struct {
	backend NodeStatser

	conflicts, rewritten, splits *prometheus.Desc
}

// NewNodeCollector returns a collector reading b.
func NewNodeCollector(b NodeStatser) *NodeCollector {
	ns := metrics.Namespace
	return &NodeCollector{
		backend: b,
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
func (c *NodeCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.conflicts
	ch <- c.rewritten
	ch <- c.splits
}

// Collect implements prometheus.Collector.
func (c *NodeCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.backend.NodeStats()
	ch <- prometheus.MustNewConstMetric(c.conflicts, prometheus.CounterValue, float64(st.NameConflicts))
	ch <- prometheus.MustNewConstMetric(c.rewritten, prometheus.CounterValue, float64(st.ReferencesRewritten))
	ch <- prometheus.MustNewConstMetric(c.splits, prometheus.CounterValue, float64(st.SplitLabelSets))
}
