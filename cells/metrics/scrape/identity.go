package scrape

import (
	"slices"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/identity"
)

// Values of the type label of identityd_identity (Cilium's).
const (
	TypeReserved     = "reserved"
	TypeWellKnown    = "well_known"
	TypeClusterLocal = "cluster_local"
	TypeNodeLocal    = "node_local"
	TypeRemoteNode   = "remote_node"
)

// Values of the scope label of identityd_identity_space_usage_ratio.
const (
	SpaceGlobal     = "global"
	SpaceNodeLocal  = "node_local"
	SpaceRemoteNode = "remote_node"
)

// IdentityCollector reports the allocator's identities by type, label
// source and ID space usage. It lists the allocator at every scrape, which
// costs one pass over all identities.
type IdentityCollector struct {
	alloc   allocator.Allocator
	cluster identity.ClusterInfo

	identities    *prometheus.Desc
	labelSources  *prometheus.Desc
	spaceUsage    *prometheus.Desc
	withheld      *prometheus.Desc
	remoteCluster *prometheus.Desc
	restored      *prometheus.Desc
}

// NewIdentityCollector returns a collector reading a. cluster gives the
// global ID range whose use the space usage ratio reports.
func NewIdentityCollector(a allocator.Allocator, cluster identity.ClusterInfo) *IdentityCollector {
	ns := metrics.Namespace
	return &IdentityCollector{
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
func (c *IdentityCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.identities, c.labelSources, c.spaceUsage, c.withheld, c.remoteCluster, c.restored} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *IdentityCollector) Collect(ch chan<- prometheus.Metric) {
	byType := map[string]int{
		TypeReserved: 0, TypeWellKnown: 0, TypeClusterLocal: 0, TypeNodeLocal: 0, TypeRemoteNode: 0,
	}
	sources := map[string]int{}
	var remoteCluster, restored int
	minID, maxID := c.cluster.MinID(), c.cluster.MaxID()
	var seen []string
	for _, e := range c.alloc.List() {
		id := e.Identity.ID
		switch {
		case id.IsReserved():
			byType[TypeReserved]++
		case id.Scope() == identity.ScopeLocal:
			byType[TypeNodeLocal]++
		case id.Scope() == identity.ScopeRemoteNode:
			byType[TypeRemoteNode]++
		case e.Source != allocator.SourceRemote && id >= minID && id <= maxID:
			byType[TypeClusterLocal]++
		default:
			remoteCluster++
		}
		if e.Source == allocator.SourceRestored {
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
	ch <- prometheus.MustNewConstMetric(c.spaceUsage, prometheus.GaugeValue, float64(byType[TypeNodeLocal])/localSpace, SpaceNodeLocal)
	ch <- prometheus.MustNewConstMetric(c.spaceUsage, prometheus.GaugeValue, float64(byType[TypeRemoteNode])/localSpace, SpaceRemoteNode)
	if maxID >= minID {
		global := float64(maxID - minID + 1)
		ch <- prometheus.MustNewConstMetric(c.spaceUsage, prometheus.GaugeValue, float64(byType[TypeClusterLocal])/global, SpaceGlobal)
	}
	ch <- prometheus.MustNewConstMetric(c.withheld, prometheus.GaugeValue, float64(len(c.alloc.Withheld())))
	ch <- prometheus.MustNewConstMetric(c.remoteCluster, prometheus.GaugeValue, float64(remoteCluster))
	ch <- prometheus.MustNewConstMetric(c.restored, prometheus.GaugeValue, float64(restored))
}
