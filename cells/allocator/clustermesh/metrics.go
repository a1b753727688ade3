package clustermesh

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/identityd/identityd/cells/metrics"
)

// clusterMeshCollector exports Status as metrics at scrape time, so that
// the numbers never lag the caches.
type clusterMeshCollector struct {
	mesh                                *Mesh
	ready, synced, identities, rejected *prometheus.Desc
	rejectedTotal                       *prometheus.Desc
}

func newClusterMeshMetrics(m *Mesh) metrics.CollectorOut {
	desc := func(name, help string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(metrics.Namespace, "clustermesh", name), help, []string{"cluster"}, nil)
	}
	return metrics.NewCollector(&clusterMeshCollector{
		mesh:          m,
		ready:         desc("remote_cluster_connected", "1 when the remote cluster's etcd answers"),
		synced:        desc("remote_cluster_synced", "1 when the remote cluster's identities are listed"),
		identities:    desc("remote_cluster_identities", "Identities of the remote cluster this node knows"),
		rejected:      desc("remote_cluster_rejected_keys", "Master keys of the remote cluster currently rejected"),
		rejectedTotal: desc("remote_cluster_rejected_total", "Rejections of the remote cluster's master keys"),
	})
}

// Describe implements prometheus.Collector.
func (c *clusterMeshCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.ready, c.synced, c.identities, c.rejected, c.rejectedTotal} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *clusterMeshCollector) Collect(ch chan<- prometheus.Metric) {
	for _, st := range c.mesh.Status() {
		ch <- prometheus.MustNewConstMetric(c.ready, prometheus.GaugeValue, metrics.BoolValue(st.Connected), st.Name)
		ch <- prometheus.MustNewConstMetric(c.synced, prometheus.GaugeValue, metrics.BoolValue(st.Synced), st.Name)
		ch <- prometheus.MustNewConstMetric(c.identities, prometheus.GaugeValue, float64(st.Identities), st.Name)
		ch <- prometheus.MustNewConstMetric(c.rejected, prometheus.GaugeValue, float64(st.Rejected), st.Name)
		ch <- prometheus.MustNewConstMetric(c.rejectedTotal, prometheus.CounterValue, float64(st.RejectedTotal), st.Name)
	}
}
