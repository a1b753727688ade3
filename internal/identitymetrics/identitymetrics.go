// Package identitymetrics is the scrape-time collector of the allocator's
// identity gauges (identityd_identity, _label_sources, _space_usage_ratio,
// _withheld, _remote_cluster, _restored). It reads the identities through
// the functions it is given, at every scrape, and knows nothing else of the
// allocator.
package identitymetrics

import (
	"slices"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// Identity is what the collector needs of one identity the allocator knows.
type Identity struct {
	ID     identity.NumericIdentity
	Labels labels.Labels
	// Remote: another cluster's identity. Restored: held only by
	// restoration.
	Remote, Restored bool
}

// Source lists the identities at a scrape.
type Source struct {
	// Each calls yield for every identity.
	Each func(yield func(Identity))
	// Withheld counts the local numeric IDs withheld for restoration.
	Withheld func() int
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

// collector reports identities by type, label source and ID space usage.
// A scrape costs one pass over all identities.
type collector struct {
	src     Source
	cluster identity.ClusterInfo

	identities    *prometheus.Desc
	labelSources  *prometheus.Desc
	spaceUsage    *prometheus.Desc
	withheld      *prometheus.Desc
	remoteCluster *prometheus.Desc
	restored      *prometheus.Desc
}

// New returns the collector of src's identities, its metric names in
// namespace ns; cluster gives the global ID range whose use the space usage
// ratio reports.
func New(ns string, src Source, cluster identity.ClusterInfo) prometheus.Collector {
	return &collector{
		src:     src,
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
func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.identities, c.labelSources, c.spaceUsage, c.withheld, c.remoteCluster, c.restored} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *collector) Collect(ch chan<- prometheus.Metric) {
	byType := map[string]int{
		typeReserved: 0, typeWellKnown: 0, typeClusterLocal: 0, typeNodeLocal: 0, typeRemoteNode: 0,
	}
	sources := map[string]int{}
	var remoteCluster, restored int
	minID, maxID := c.cluster.MinID(), c.cluster.MaxID()
	var seen []string
	c.src.Each(func(e Identity) {
		id := e.ID
		switch {
		case id.IsReserved():
			byType[typeReserved]++
		case id.Scope() == identity.ScopeLocal:
			byType[typeNodeLocal]++
		case id.Scope() == identity.ScopeRemoteNode:
			byType[typeRemoteNode]++
		case !e.Remote && id >= minID && id <= maxID:
			byType[typeClusterLocal]++
		default:
			remoteCluster++
		}
		if e.Restored {
			restored++
		}
		// An identity counts once per source, however many of its
		// labels have it.
		seen = seen[:0]
		for _, l := range e.Labels {
			if !slices.Contains(seen, l.Source) {
				seen = append(seen, l.Source)
				sources[l.Source]++
			}
		}
	})
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
	ch <- prometheus.MustNewConstMetric(c.withheld, prometheus.GaugeValue, float64(c.src.Withheld()))
	ch <- prometheus.MustNewConstMetric(c.remoteCluster, prometheus.GaugeValue, float64(remoteCluster))
	ch <- prometheus.MustNewConstMetric(c.restored, prometheus.GaugeValue, float64(restored))
}
