package clustermesh

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/identityd/identityd/cells/metrics"
)

// newClusterMeshMetrics exports Status as metrics at scrape time, so that
// the numbers never lag the caches.
func newClusterMeshMetrics(mesh *Mesh) metrics.CollectorOut {
	desc := func(name, help string) *prometheus.Desc {
		return metrics.NewDesc("clustermesh_"+name, help, "cluster")
	}
	var (
		ready         = desc("remote_cluster_connected", "1 when the remote cluster's etcd answers")
		synced        = desc("remote_cluster_synced", "1 when the remote cluster's identities are listed")
		identities    = desc("remote_cluster_identities", "Identities of the remote cluster this node knows")
		rejected      = desc("remote_cluster_rejected_keys", "Master keys of the remote cluster currently rejected")
		rejectedTotal = desc("remote_cluster_rejected_total", "Rejections of the remote cluster's master keys")
	)
	return metrics.NewCollector(metrics.NewScrapeCollector(func(m metrics.Scrape) {
		for _, st := range mesh.Status() {
			m.Gauge(ready, metrics.BoolValue(st.Connected), st.Name)
			m.Gauge(synced, metrics.BoolValue(st.Synced), st.Name)
			m.Gauge(identities, float64(st.Identities), st.Name)
			m.Gauge(rejected, float64(st.Rejected), st.Name)
			m.Counter(rejectedTotal, float64(st.RejectedTotal), st.Name)
		}
	}, ready, synced, identities, rejected, rejectedTotal))
}
