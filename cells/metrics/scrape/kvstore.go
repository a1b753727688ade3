package scrape

import (
	"context"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/metrics"
)

// kvstoreStatusTimeout bounds the status requests of one scrape, so that an
// unreachable etcd makes the scrape slow, not stuck.
const kvstoreStatusTimeout = 5 * time.Second

// KVStoreCollector reports the etcd client's request counts and
// connectivity. Each scrape sends one Status request per endpoint, which
// shows in the Status method's request count.
//
// It is a start and stop hook too: the status requests of a scrape end at
// its stop (appended after the client's hook, it stops before the client),
// so that a scrape in flight when the agent stops does not wait for an
// unreachable etcd.
type KVStoreCollector struct {
	client *kvstore.Client
	// scrapes bounds every scrape's status requests: cancelled by Stop.
	scrapes context.Context
	stop    context.CancelFunc

	requests, connected, endpoints, lease *prometheus.Desc
}

// NewKVStoreCollector returns a collector reading client.
func NewKVStoreCollector(client *kvstore.Client) *KVStoreCollector {
	ns := metrics.Namespace
	// The root of the scrapes' requests, which no goroutine runs on:
	// Stop cancels it.
	scrapes, stop := context.WithCancel(context.Background())
	return &KVStoreCollector{
		client:  client,
		scrapes: scrapes,
		stop:    stop,
		requests: prometheus.NewDesc(ns+"_kvstore_requests_total",
			"Number of etcd requests this node sent, by gRPC method (streams count once when opened; LeaseGrant counts lease creations and re-creations)",
			[]string{"method"}, nil),
		connected: prometheus.NewDesc(ns+"_kvstore_connected",
			"1 when at least one etcd endpoint answered a status request during this scrape, else 0", nil, nil),
		endpoints: prometheus.NewDesc(ns+"_kvstore_endpoints",
			"Number of configured etcd endpoints, by whether they answered during this scrape",
			[]string{"state"}, nil),
		lease: prometheus.NewDesc(ns+"_kvstore_lease_held",
			"1 when this node holds an etcd lease for its keys, else 0", nil, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *KVStoreCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.requests
	ch <- c.connected
	ch <- c.endpoints
	ch <- c.lease
}

// Collect implements prometheus.Collector.
func (c *KVStoreCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(c.scrapes, kvstoreStatusTimeout)
	defer cancel()
	st := c.client.Status(ctx)
	up := st.Connected()
	ch <- prometheus.MustNewConstMetric(c.connected, prometheus.GaugeValue, boolValue(up > 0))
	ch <- prometheus.MustNewConstMetric(c.endpoints, prometheus.GaugeValue, float64(up), "connected")
	ch <- prometheus.MustNewConstMetric(c.endpoints, prometheus.GaugeValue, float64(len(st.Endpoints)-up), "unreachable")
	ch <- prometheus.MustNewConstMetric(c.lease, prometheus.GaugeValue, boolValue(st.LeaseID != 0))
	// Counts are read after the status requests so that those are in.
	for method, n := range c.client.RequestCounts() {
		ch <- prometheus.MustNewConstMetric(c.requests, prometheus.CounterValue, float64(n), method)
	}
}

// Start implements cell.HookInterface.
func (c *KVStoreCollector) Start(cell.HookContext) error { return nil }

// Stop implements cell.HookInterface: it ends the status requests of
// scrapes in flight; those of later scrapes fail at once.
func (c *KVStoreCollector) Stop(cell.HookContext) error {
	c.stop()
	return nil
}
