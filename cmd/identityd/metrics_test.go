package main

import (
	"context"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/labels"
)

// TestAgentServesCellMetrics: metrics that cells record themselves reach
// the agent's /metrics endpoint with the values of a workload.
func TestAgentServesCellMetrics(t *testing.T) {
	var (
		a   allocator.Allocator
		srv *metrics.Server
	)
	cells := append(slices.Clone(agentCells), cell.Invoke(func(x allocator.Allocator, s *metrics.Server) { a, srv = x, s }))
	h := hive.New(cells...)
	dir := t.TempDir()
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(h, func(c *metrics.Config) { c.PrometheusServeAddr = "127.0.0.1:0" })
	hive.AddConfigOverride(h, func(c *ipcache.Config) { c.IPCacheMap = "file" })
	// No GC: its election's transaction would add to the count below at
	// a moment of its own.
	hive.AddConfigOverride(h, func(c *globalstore.Config) { c.IdentityGCInterval = 0 })
	log := hivetest.Logger(t)
	if err := h.Start(log, context.Background()); err != nil {
		t.Fatal(err)
	}
	defer h.Stop(log, context.Background())

	for _, l := range [][]string{{"cidr:10.0.0.0/8", "reserved:world"}, {"cidr:10.0.0.0/8", "reserved:world"}, {"k8s:app=web"}} {
		if _, _, err := a.Allocate(t.Context(), labels.MustParse(l...)); err != nil {
			t.Fatal(err)
		}
	}
	resp, err := http.Get("http://" + srv.Addr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{
		`identityd_identity_allocation_duration_seconds_count{outcome="success",scope="local"} 2`,
		`identityd_identity_allocation_duration_seconds_count{outcome="success",scope="global"} 1`,
		`identityd_identity{type="node_local"} 1`,
		// The claim of the node name at start and the global
		// allocation's transaction, timed by the kvstore client.
		`identityd_kvstore_operations_duration_seconds_count{action="Txn",kind="KV",outcome="success",scope="cilium/state/identities"} 2`,
	} {
		if !strings.Contains(string(body), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}
