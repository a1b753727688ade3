package kvstore_test

import (
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"

	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/internal/metricstest"
	"github.com/identityd/identityd/internal/testhive"
)

func TestScrapeKVStore(t *testing.T) {
	var (
		client *kvstore.Client
		server *metrics.Server
	)
	h := hive.New(
		health.Cell, metrics.Cell, statedir.Cell, kvstore.Cell,
		cell.Invoke(func(c *kvstore.Client, s *metrics.Server) { client, server = c, s }),
	)
	dir := t.TempDir()
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(h, func(c *kvstore.Config) { c.NodeName = "metrics-node" })
	hive.AddConfigOverride(h, func(c *metrics.Config) { c.PrometheusServeAddr = "127.0.0.1:0" })
	testhive.Start(t, h)

	if _, err := client.Lease(t.Context()); err != nil {
		t.Fatal(err)
	}
	before := client.RequestCounts()
	samples := metricstest.Scrape(t, server.Addr())
	metricstest.Expect(t, samples, map[string]float64{
		`identityd_kvstore_connected`:                           1,
		`identityd_kvstore_endpoints{state="connected"}`:        1,
		`identityd_kvstore_endpoints{state="unreachable"}`:      0,
		`identityd_kvstore_lease_held`:                          1,
		`identityd_kvstore_requests_total{method="LeaseGrant"}`: float64(before["LeaseGrant"]),
		// The scrape's own status request is counted.
		`identityd_kvstore_requests_total{method="Status"}`: float64(before["Status"] + 1),
	})
}
