package main

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/checkpoint"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/ipcachemap"
	"github.com/identityd/identityd/internal/metricstest"
	"github.com/identityd/identityd/labels"
)

// The metrics of the allocator, checkpoint and ipcache cells together, as
// the agent serves them.

type metricsAgent struct {
	alloc  allocator.Allocator
	cp     *checkpoint.Checkpoint
	ipc    *ipcache.IPCache
	server *metrics.Server
}

// startMetricsAgent runs a hive like the agent's, without the kvstore: the
// allocator, checkpoint and ipcache (file map), with metrics on a free port.
func startMetricsAgent(t *testing.T) *metricsAgent {
	t.Helper()
	var a metricsAgent
	opts := hive.DefaultOptions()
	opts.ModuleDecorators = health.ModuleDecorators
	h := hive.NewWithOptions(opts,
		health.Cell, metrics.Cell,
		job.Cell, statedb.Cell, statedir.Cell,
		allocator.Cell, checkpoint.Cell, ipcache.Cell,
		cell.Invoke(func(al allocator.Allocator, cp *checkpoint.Checkpoint, ipc *ipcache.IPCache, s *metrics.Server) {
			a = metricsAgent{al, cp, ipc, s}
		}),
	)
	dir := t.TempDir()
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(h, func(c *ipcache.Config) { c.IPCacheMap = string(ipcachemap.KindFile) })
	// Remote nodes' label sets get remote-node-scope identities, as the
	// tests expect (Cilium's --policy-cidr-match-mode=nodes).
	hive.AddConfigOverride(h, func(c *allocator.Config) { c.PolicyCIDRMatchMode = []string{allocator.PolicyCIDRMatchNodes} })
	hive.AddConfigOverride(h, func(c *metrics.Config) { c.PrometheusServeAddr = "127.0.0.1:0" })
	log := hivetest.Logger(t)
	if err := h.Start(log, t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := h.Stop(log, context.Background()); err != nil {
			t.Error(err)
		}
	})
	return &a
}

func TestScrapeValues(t *testing.T) {
	a := startMetricsAgent(t)
	ctx := t.Context()

	const n, released = 20, 5
	var ids []*identity.Identity
	for i := range n {
		lbls := labels.MustParse(fmt.Sprintf("cidr:10.1.%d.0/24", i), "reserved:world")
		id, _, err := a.alloc.Allocate(ctx, lbls)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	// A remote-node-scope identity, and a second reference on one that
	// is then released once: it must stay.
	if _, _, err := a.alloc.Allocate(ctx, labels.MustParse("cidr:192.168.0.1/32", "reserved:remote-node")); err != nil {
		t.Fatal(err)
	}
	if _, _, err := a.alloc.Allocate(ctx, ids[0].Labels); err != nil {
		t.Fatal(err)
	}
	for _, id := range ids[:released] {
		if _, err := a.alloc.Release(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	a.alloc.Withhold([]identity.NumericIdentity{identity.NumericIdentity(identity.ScopeLocal) | 5000})
	// The ipcache allocates the prefix's CIDR identity itself.
	if err := a.ipc.Upsert(ctx, "test", netip.MustParsePrefix("172.16.0.0/16"), ipcache.Info{}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.cp.Write(); err != nil {
		t.Fatal(err)
	}

	// ids[0] is still held (second reference), plus the ipcache prefix.
	const nodeLocal = float64(n - released + 1 + 1)
	samples := metricstest.Scrape(t, a.server.Addr())
	metricstest.Expect(t, samples, map[string]float64{
		`identityd_identity{type="reserved"}`:                       10,
		`identityd_identity{type="well_known"}`:                     0,
		`identityd_identity{type="cluster_local"}`:                  0,
		`identityd_identity{type="node_local"}`:                     nodeLocal,
		`identityd_identity{type="remote_node"}`:                    1,
		`identityd_identity_label_sources{source="cidr"}`:           nodeLocal + 1,
		`identityd_identity_label_sources{source="reserved"}`:       10 + nodeLocal + 1,
		`identityd_identity_space_usage_ratio{scope="node_local"}`:  nodeLocal / float64(identity.MaxLocalIdentity),
		`identityd_identity_space_usage_ratio{scope="remote_node"}`: 1 / float64(identity.MaxLocalIdentity),
		`identityd_identity_space_usage_ratio{scope="global"}`:      0,
		`identityd_identity_withheld`:                               1,
		`identityd_identity_remote_cluster`:                         0,
		`identityd_checkpoint_writes_total`:                         1,
		`identityd_checkpoint_write_failures_total`:                 0,
		`identityd_checkpoint_entries`:                              nodeLocal + 1,
		`identityd_checkpoint_last_write_failed`:                    0,
		`identityd_ipcache_entries`:                                 1,
		`identityd_ipcache_reconciliation_errors`:                   0,
	})
	if v := samples[`identityd_checkpoint_size_bytes`]; v <= 2 {
		t.Errorf("checkpoint size %v, want the bytes of %v identities", v, nodeLocal+1)
	}
	if v := samples[`identityd_checkpoint_last_success_timestamp_seconds`]; v < float64(time.Now().Add(-time.Minute).Unix()) {
		t.Errorf("last success timestamp %v is not recent", v)
	}
	if _, ok := samples[`go_goroutines`]; !ok {
		t.Error("go collector missing")
	}
	if _, ok := samples[`process_start_time_seconds`]; !ok {
		t.Error("process collector missing")
	}
	// No kvstore in this hive: no kvstore metrics rather than zeros.
	for name := range samples {
		if strings.HasPrefix(name, "identityd_kvstore_") {
			t.Errorf("unexpected %s without a kvstore", name)
		}
	}

	// Releasing the rest shows at the next scrape.
	for _, id := range ids[released:] {
		if _, err := a.alloc.Release(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := a.alloc.Release(ctx, ids[0]); err != nil {
		t.Fatal(err)
	}
	metricstest.Expect(t, metricstest.Scrape(t, a.server.Addr()), map[string]float64{
		`identityd_identity{type="node_local"}`: 1, // the ipcache prefix
	})
}

// Two agents in one process keep their own registries and values.
func TestTwoHivesDoNotInterfere(t *testing.T) {
	a1, a2 := startMetricsAgent(t), startMetricsAgent(t)
	for i := range 3 {
		if _, _, err := a1.alloc.Allocate(t.Context(), labels.MustParse(fmt.Sprintf("cidr:10.2.%d.0/24", i))); err != nil {
			t.Fatal(err)
		}
	}
	metricstest.Expect(t, metricstest.Scrape(t, a1.server.Addr()), map[string]float64{`identityd_identity{type="node_local"}`: 3})
	metricstest.Expect(t, metricstest.Scrape(t, a2.server.Addr()), map[string]float64{`identityd_identity{type="node_local"}`: 0})
}

// Without a kvstore there is no GC, and no GC series rather than zeros.
func TestScrapeNoGCWithoutKVStore(t *testing.T) {
	a := startMetricsAgent(t)
	for name := range metricstest.Scrape(t, a.server.Addr()) {
		if strings.HasPrefix(name, "identityd_identity_gc_") {
			t.Errorf("unexpected %s without a kvstore", name)
		}
	}
}
