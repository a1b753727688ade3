package scrape_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/checkpoint"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/cells/metrics/scrape"
	"github.com/identityd/identityd/cells/restoration"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/ipcachemap"
	"github.com/identityd/identityd/labels"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type agent struct {
	alloc  allocator.Allocator
	cp     *checkpoint.Checkpoint
	ipc    *ipcache.IPCache
	server *metrics.Server
}

// startAgent runs a hive like the agent's, without the kvstore: the
// allocator, checkpoint and ipcache (file map), with metrics on a free port.
func startAgent(t *testing.T) *agent {
	t.Helper()
	var a agent
	opts := hive.DefaultOptions()
	opts.ModuleDecorators = health.ModuleDecorators
	h := hive.NewWithOptions(opts,
		health.Cell, metrics.Cell, scrape.Cell,
		job.Cell, statedb.Cell, statedir.Cell,
		allocator.Cell, checkpoint.Cell, ipcache.Cell,
		cell.Invoke(func(al allocator.Allocator, cp *checkpoint.Checkpoint, ipc *ipcache.IPCache, s *metrics.Server) {
			a = agent{al, cp, ipc, s}
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

// scrape fetches /metrics and returns every sample as "name{labels}" ->
// value.
func scrapeMetrics(t *testing.T, addr string) map[string]float64 {
	t.Helper()
	resp, err := http.Get("http://" + addr + metrics.MetricsPath)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape: %d %v\n%s", resp.StatusCode, err, body)
	}
	out := map[string]float64{}
	for line := range strings.Lines(string(body)) {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			t.Fatalf("bad sample %q: %v", line, err)
		}
		out[line[:i]] = v
	}
	return out
}

func expect(t *testing.T, samples map[string]float64, want map[string]float64) {
	t.Helper()
	for name, w := range want {
		got, ok := samples[name]
		if !ok {
			t.Errorf("%s missing", name)
			continue
		}
		if got != w {
			t.Errorf("%s = %v, want %v", name, got, w)
		}
	}
}

func TestScrapeValues(t *testing.T) {
	a := startAgent(t)
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
	samples := scrapeMetrics(t, a.server.Addr())
	expect(t, samples, map[string]float64{
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
	expect(t, scrapeMetrics(t, a.server.Addr()), map[string]float64{
		`identityd_identity{type="node_local"}`: 1, // the ipcache prefix
	})
}

// Two agents in one process keep their own registries and values.
func TestTwoHivesDoNotInterfere(t *testing.T) {
	a1, a2 := startAgent(t), startAgent(t)
	for i := range 3 {
		if _, _, err := a1.alloc.Allocate(t.Context(), labels.MustParse(fmt.Sprintf("cidr:10.2.%d.0/24", i))); err != nil {
			t.Fatal(err)
		}
	}
	expect(t, scrapeMetrics(t, a1.server.Addr()), map[string]float64{`identityd_identity{type="node_local"}`: 3})
	expect(t, scrapeMetrics(t, a2.server.Addr()), map[string]float64{`identityd_identity{type="node_local"}`: 0})
}

func TestScrapeKVStore(t *testing.T) {
	var (
		client *kvstore.Client
		server *metrics.Server
	)
	h := hive.New(
		health.Cell, metrics.Cell, scrape.Cell, statedir.Cell, kvstore.Cell,
		cell.Invoke(func(c *kvstore.Client, s *metrics.Server) { client, server = c, s }),
	)
	dir := t.TempDir()
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(h, func(c *kvstore.Config) { c.NodeName = "metrics-node" })
	hive.AddConfigOverride(h, func(c *metrics.Config) { c.PrometheusServeAddr = "127.0.0.1:0" })
	log := hivetest.Logger(t)
	if err := h.Start(log, t.Context()); err != nil {
		t.Fatal(err)
	}
	defer h.Stop(log, context.Background())

	if _, err := client.Lease(t.Context()); err != nil {
		t.Fatal(err)
	}
	before := client.RequestCounts()
	samples := scrapeMetrics(t, server.Addr())
	expect(t, samples, map[string]float64{
		`identityd_kvstore_connected`:                           1,
		`identityd_kvstore_endpoints{state="connected"}`:        1,
		`identityd_kvstore_endpoints{state="unreachable"}`:      0,
		`identityd_kvstore_lease_held`:                          1,
		`identityd_kvstore_requests_total{method="LeaseGrant"}`: float64(before["LeaseGrant"]),
		// The scrape's own status request is counted.
		`identityd_kvstore_requests_total{method="Status"}`: float64(before["Status"] + 1),
	})
}

func TestScrapeGC(t *testing.T) {
	var (
		alloc   allocator.Allocator
		backend globalstore.Backend
		server  *metrics.Server
	)
	h := hive.New(
		health.Cell, metrics.Cell, scrape.Cell, job.Cell, statedb.Cell, statedir.Cell,
		kvstore.Cell, allocator.Cell, etcdstore.Cell,
		cell.Invoke(func(a allocator.Allocator, b globalstore.Backend, s *metrics.Server) {
			alloc, backend, server = a, b, s
		}),
	)
	dir := t.TempDir()
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(h, func(c *metrics.Config) { c.PrometheusServeAddr = "127.0.0.1:0" })
	// The test runs the GC itself, so that the counts are exact.
	hive.AddConfigOverride(h, func(c *etcdstore.Config) { c.IdentityGCInterval = 0 })
	log := hivetest.Logger(t)
	if err := h.Start(log, t.Context()); err != nil {
		t.Fatal(err)
	}
	defer h.Stop(log, context.Background())
	etcd, ok := backend.(*etcdstore.Store)
	if !ok {
		t.Fatalf("global backend is %T, want the etcd backend", backend)
	}

	expect(t, scrapeMetrics(t, server.Addr()), map[string]float64{
		`identityd_identity_gc_entries{status="deleted"}`: 0,
		`identityd_identity_gc_entries{status="skipped"}`: 0,
		`identityd_identity_gc_runs{outcome="success"}`:   0,
		`identityd_identity_gc_runs{outcome="failure"}`:   0,
	})

	// Two global identities nobody holds any more, one still held.
	var unused []*identity.Identity
	for _, app := range []string{"a", "b", "c"} {
		id, _, err := alloc.Allocate(t.Context(), labels.MustParse("k8s:app="+app))
		if err != nil {
			t.Fatal(err)
		}
		unused = append(unused, id)
	}
	for _, id := range unused[:2] {
		if _, err := alloc.Release(t.Context(), id); err != nil {
			t.Fatal(err)
		}
	}
	if deleted, _, err := etcd.RunGC(t.Context()); err != nil || deleted != 2 {
		t.Fatalf("GC deleted %d, err %v; want 2", deleted, err)
	}
	// A run that cannot reach etcd counts as a failure.
	cancelled, cancel := context.WithCancel(t.Context())
	cancel()
	if _, _, err := etcd.RunGC(cancelled); err == nil {
		t.Fatal("GC with a cancelled context succeeded")
	}
	expect(t, scrapeMetrics(t, server.Addr()), map[string]float64{
		`identityd_identity_gc_entries{status="deleted"}`: 2,
		`identityd_identity_gc_entries{status="skipped"}`: 0,
		`identityd_identity_gc_runs{outcome="success"}`:   1,
		`identityd_identity_gc_runs{outcome="failure"}`:   1,
	})
}

func TestScrapeNodeChecks(t *testing.T) {
	var (
		alloc   allocator.Allocator
		backend globalstore.Backend
		kv      *kvstore.Client
		server  *metrics.Server
	)
	h := hive.New(
		health.Cell, metrics.Cell, scrape.Cell, job.Cell, statedb.Cell, statedir.Cell,
		kvstore.Cell, allocator.Cell, etcdstore.Cell,
		cell.Invoke(func(a allocator.Allocator, b globalstore.Backend, k *kvstore.Client, s *metrics.Server) {
			alloc, backend, kv, server = a, b, k, s
		}),
	)
	dir := t.TempDir()
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(h, func(c *metrics.Config) { c.PrometheusServeAddr = "127.0.0.1:0" })
	hive.AddConfigOverride(h, func(c *kvstore.Config) { c.NodeName = "scraped" })
	// The test runs the checks itself, so that the counts are exact.
	hive.AddConfigOverride(h, func(c *etcdstore.Config) { c.KVStorePeriodicSync = 0 })
	log := hivetest.Logger(t)
	if err := h.Start(log, t.Context()); err != nil {
		t.Fatal(err)
	}
	defer h.Stop(log, context.Background())
	etcd := backend.(*etcdstore.Store)
	expect(t, scrapeMetrics(t, server.Addr()), map[string]float64{
		`identityd_kvstore_node_name_conflicts_total`:  0,
		`identityd_kvstore_references_rewritten_total`: 0,
	})

	l := labels.MustParse("k8s:app=scraped")
	id, _, err := alloc.Allocate(t.Context(), l)
	if err != nil {
		t.Fatal(err)
	}
	// Another writer of this node's name rewrites its reference on
	// another lease.
	cli := kv.Client()
	other, err := cli.Grant(t.Context(), 60)
	if err != nil {
		t.Fatal(err)
	}
	ref := etcdstore.ReferenceKeyPrefix + l.Canonical() + "/scraped"
	if _, err := cli.Put(t.Context(), ref, id.ID.String(), clientv3.WithLease(other.ID)); err != nil {
		t.Fatal(err)
	}
	if n, err := etcd.SyncReferences(t.Context()); err != nil || n != 1 {
		t.Fatalf("sync rewrote %d, err %v; want 1", n, err)
	}
	expect(t, scrapeMetrics(t, server.Addr()), map[string]float64{
		`identityd_kvstore_node_name_conflicts_total`:  1,
		`identityd_kvstore_references_rewritten_total`: 1,
	})
}

// Without a kvstore there is no GC, and no GC series rather than zeros.
func TestScrapeNoGCWithoutKVStore(t *testing.T) {
	a := startAgent(t)
	for name := range scrapeMetrics(t, a.server.Addr()) {
		if strings.HasPrefix(name, "identityd_identity_gc_") {
			t.Errorf("unexpected %s without a kvstore", name)
		}
	}
}

// restoringAgent is startAgent's hive with restoration, on a state
// directory that outlives it, so that a second one restores the first's.
type restoringAgent struct {
	h   *hive.Hive
	ipc *ipcache.IPCache
	r   *restoration.Restorer
	srv *metrics.Server
}

func startRestoringAgent(t *testing.T, dir string, grace time.Duration) *restoringAgent {
	t.Helper()
	var a restoringAgent
	opts := hive.DefaultOptions()
	opts.ModuleDecorators = health.ModuleDecorators
	a.h = hive.NewWithOptions(opts,
		health.Cell, metrics.Cell, scrape.Cell,
		job.Cell, statedb.Cell, statedir.Cell,
		allocator.Cell, checkpoint.Cell, ipcache.Cell, restoration.Cell,
		cell.Invoke(func(ipc *ipcache.IPCache, r *restoration.Restorer, s *metrics.Server) {
			a.ipc, a.r, a.srv = ipc, r, s
		}),
	)
	hive.AddConfigOverride(a.h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(a.h, func(c *ipcache.Config) { c.IPCacheMap = string(ipcachemap.KindFile) })
	hive.AddConfigOverride(a.h, func(c *metrics.Config) { c.PrometheusServeAddr = "127.0.0.1:0" })
	hive.AddConfigOverride(a.h, func(c *restoration.Config) { c.IdentityRestoreGracePeriod = grace })
	if err := a.h.Start(hivetest.Logger(t), t.Context()); err != nil {
		t.Fatal(err)
	}
	select {
	case <-a.r.Ready():
	case <-time.After(time.Minute):
		t.Fatalf("restoration not ready: %+v", a.r.Status())
	}
	return &a
}

func (a *restoringAgent) stop(t *testing.T) {
	t.Helper()
	if err := a.h.Stop(hivetest.Logger(t), context.Background()); err != nil {
		t.Fatal(err)
	}
}

func TestScrapeRestoration(t *testing.T) {
	dir := t.TempDir()

	// The first run leaves two CIDR identities in the checkpoint and
	// their prefixes in the map file.
	a := startRestoringAgent(t, dir, time.Hour)
	expect(t, scrapeMetrics(t, a.srv.Addr()), map[string]float64{
		`identityd_identity_restoration{result="restored"}`:                               0,
		`identityd_identity_restoration{result="skipped"}`:                                0,
		`identityd_identity_restoration{result="released_after_grace"}`:                   0,
		`identityd_identity_restoration_prefixes{result="restored"}`:                      0,
		`identityd_identity_restoration_prefixes{result="failed"}`:                        0,
		`identityd_identity_restoration_skipped_map_entries_total{reason="shared_id"}`:    0,
		`identityd_identity_restoration_skipped_map_entries_total{reason="other_labels"}`: 0,
	})
	for _, p := range []string{"10.1.0.0/16", "10.2.0.0/16"} {
		if err := a.ipc.Upsert(t.Context(), "test", netip.MustParsePrefix(p), ipcache.Info{}); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.ipc.WaitForMap(t.Context()); err != nil {
		t.Fatal(err)
	}
	first, ok := a.ipc.LookupPrefix(netip.MustParsePrefix("10.1.0.0/16"))
	if !ok {
		t.Fatal("10.1.0.0/16 not in the ipcache")
	}
	a.stop(t)

	// A damaged map gives a third prefix the first one's ID: restoration
	// skips that entry and counts it.
	m, _, err := ipcachemap.Open(ipcachemap.Config{Kind: ipcachemap.KindFile, FilePath: filepath.Join(dir, ipcachemap.FileName)})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.UpdateBatch([]ipcachemap.Entry{{
		Key:   ipcachemap.Key{Prefix: netip.MustParsePrefix("10.3.0.0/16")},
		Value: ipcachemap.Value{Identity: first.Identity},
	}}); err != nil {
		t.Fatal(err)
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}

	// An entry another agent's rules would accept but this one's would
	// not (a local checkpoint holds no global IDs) is skipped.
	cpFile := filepath.Join(dir, checkpoint.FileName)
	data, err := os.ReadFile(cpFile)
	if err != nil {
		t.Fatal(err)
	}
	body := strings.TrimSuffix(strings.TrimSpace(string(data)), "]")
	data = []byte(body + `,{"id":256,"labels":{"app":"k8s:app=web"}}]`)
	if err := os.WriteFile(cpFile, data, 0o600); err != nil {
		t.Fatal(err)
	}

	// Nobody takes the restored identities up again: after the grace
	// period they are released.
	b := startRestoringAgent(t, dir, 100*time.Millisecond)
	defer b.stop(t)
	expect(t, scrapeMetrics(t, b.srv.Addr()), map[string]float64{
		`identityd_identity_restoration{result="restored"}`:                               2,
		`identityd_identity_restoration{result="skipped"}`:                                1,
		`identityd_identity_restoration_prefixes{result="restored"}`:                      2,
		`identityd_identity_restoration_prefixes{result="failed"}`:                        0,
		`identityd_identity_restoration_skipped_map_entries_total{reason="shared_id"}`:    1,
		`identityd_identity_restoration_skipped_map_entries_total{reason="other_labels"}`: 0,
	})
	deadline := time.Now().Add(30 * time.Second)
	for b.r.Status().State != restoration.StateReleased {
		if time.Now().After(deadline) {
			t.Fatalf("restorer did not release: %+v", b.r.Status())
		}
		time.Sleep(10 * time.Millisecond)
	}
	expect(t, scrapeMetrics(t, b.srv.Addr()), map[string]float64{
		`identityd_identity_restoration{result="released_after_grace"}`: 2,
	})
}
