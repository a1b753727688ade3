package allocator

import (
	"slices"
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
	metrics.CollectorOut

	Metrics *allocationMetrics
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
	return allocationMetricsOut{Metrics: m, CollectorOut: metrics.NewCollector(m.duration)}
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

// Values of the type label of identityd_identity (Cilium's).
const (
	typeReserved     = "reserved"
	typeWellKnown    = "well_known"
	typeClusterLocal = "cluster_local"
	typeNodeLocal    = "node_local"
	typeRemoteNode   = "remote_node"
)

// Values of the scope label of identityd_identity_space_usage_ratio.
const (
	spaceGlobal     = "global"
	spaceNodeLocal  = "node_local"
	spaceRemoteNode = "remote_node"
)

// newIdentityMetrics contributes the identities collector. cluster gives
// the global ID range whose use the space usage ratio reports.
func newIdentityMetrics(a Allocator, cluster identity.ClusterInfo) metrics.CollectorOut {
	return metrics.NewCollector(newIdentityCollector(a, cluster))
}

// identityCollector reports the allocator's identities by type, label
// source and ID space usage. It lists the allocator at every scrape, which
// costs one pass over all identities.
type identityCollector struct {
	alloc   Allocator
	cluster identity.ClusterInfo

	identities    *prometheus.Desc
	labelSources  *prometheus.Desc
	spaceUsage    *prometheus.Desc
	withheld      *prometheus.Desc
	remoteCluster *prometheus.Desc
	restored      *prometheus.Desc
}

func newIdentityCollector(a Allocator, cluster identity.ClusterInfo) *identityCollector {
	ns := metrics.Namespace
	return &identityCollector{
		alloc:   a,
		cluster: cluster,
		identities: prometheus.NewDesc(ns+"_identity",
			"Number of identities this node knows, by type: reserved, well_known, cluster_local (global identities of this cluster), node_local, remote_node",
			[]string{"type"}, nil),
		labelSources: prometheus.NewDesc(ns+"_identity_label_sources",
			"Number of identities that have at least one label of the source",
			[]string{"source"}, nil),
		spaceUsage: prometheus.NewDesc(ns+"_identity_space_usage_ratio",
			"Fraction of the numeric ID space in use, by scope: node_local and remote_node (of 2^24-1 each), global (of this cluster's range)",
			[]string{"scope"}, nil),
		withheld: prometheus.NewDesc(ns+"_identity_withheld",
			"Number of local numeric IDs withheld for restoration", nil, nil),
		remoteCluster: prometheus.NewDesc(ns+"_identity_remote_cluster",
			"Number of global identities of other clusters of the mesh this node watches", nil, nil),
		restored: prometheus.NewDesc(ns+"_identity_restored",
			"Number of identities held only by restoration, to be released after the grace period unless used again", nil, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *identityCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.identities, c.labelSources, c.spaceUsage, c.withheld, c.remoteCluster, c.restored} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *identityCollector) Collect(ch chan<- prometheus.Metric) {
	byType := map[string]int{
		typeReserved: 0, typeWellKnown: 0, typeClusterLocal: 0, typeNodeLocal: 0, typeRemoteNode: 0,
	}
	sources := map[string]int{}
	var remoteCluster, restored int
	minID, maxID := c.cluster.MinID(), c.cluster.MaxID()
	var seen []string
	for _, e := range c.alloc.List() {
		id := e.Identity.ID
		switch {
		case id.IsReserved():
			byType[typeReserved]++
		case id.Scope() == identity.ScopeLocal:
			byType[typeNodeLocal]++
		case id.Scope() == identity.ScopeRemoteNode:
			byType[typeRemoteNode]++
		case e.Source != SourceRemote && id >= minID && id <= maxID:
			byType[typeClusterLocal]++
		default:
			remoteCluster++
		}
		if e.Source == SourceRestored {
			restored++
		}
		// An identity counts once per source, however many of its
		// labels have it.
		seen = seen[:0]
		for _, l := range e.Identity.Labels {
			if !slices.Contains(seen, l.Source) {
				seen = append(seen, l.Source)
				sources[l.Source]++
			}
		}
	}
	for t, n := range byType {
		ch <- prometheus.MustNewConstMetric(c.identities, prometheus.GaugeValue, float64(n), t)
	}
	for s, n := range sources {
		ch <- prometheus.MustNewConstMetric(c.labelSources, prometheus.GaugeValue, float64(n), s)
	}
	localSpace := float64(identity.MaxLocalIdentity - identity.MinLocalIdentity + 1)
	ch <- prometheus.MustNewConstMetric(c.spaceUsage, prometheus.GaugeValue, float64(byType[typeNodeLocal])/localSpace, spaceNodeLocal)
	ch <- prometheus.MustNewConstMetric(c.spaceUsage, prometheus.GaugeValue, float64(byType[typeRemoteNode])/localSpace, spaceRemoteNode)
	if maxID >= minID {
		global := float64(maxID - minID + 1)
		ch <- prometheus.MustNewConstMetric(c.spaceUsage, prometheus.GaugeValue, float64(byType[typeClusterLocal])/global, spaceGlobal)
	}
	ch <- prometheus.MustNewConstMetric(c.withheld, prometheus.GaugeValue, float64(len(c.alloc.Withheld())))
	ch <- prometheus.MustNewConstMetric(c.remoteCluster, prometheus.GaugeValue, float64(remoteCluster))
	ch <- prometheus.MustNewConstMetric(c.restored, prometheus.GaugeValue, float64(restored))
}
