package restoration_test

import (
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/checkpoint"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/cells/restoration"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/internal/ipcachemap"
	"github.com/identityd/identityd/internal/metricstest"
	"github.com/identityd/identityd/internal/testhive"
)

// restoringAgent runs the allocator, checkpoint, ipcache (file map) and
// restoration with metrics on a free port, on a state directory that
// outlives it, so that a second one restores the first's.
type restoringAgent struct {
	h       *hive.Hive
	running *testhive.Running
	ipc     *ipcache.IPCache
	r       *restoration.Restorer
	srv     *metrics.Server
	alloc   allocator.Allocator
}

func startRestoringAgent(t *testing.T, dir string, grace time.Duration) *restoringAgent {
	t.Helper()
	var a restoringAgent
	opts := hive.DefaultOptions()
	opts.ModuleDecorators = health.ModuleDecorators
	a.h = hive.NewWithOptions(opts,
		health.Cell, metrics.Cell,
		job.Cell, statedb.Cell, statedir.Cell,
		allocator.Cell, checkpoint.Cell, ipcache.Cell, restoration.Cell,
		cell.Invoke(func(ipc *ipcache.IPCache, r *restoration.Restorer, s *metrics.Server, al allocator.Allocator) {
			a.ipc, a.r, a.srv, a.alloc = ipc, r, s, al
		}),
	)
	hive.AddConfigOverride(a.h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(a.h, func(c *ipcache.Config) { c.IPCacheMap = string(ipcachemap.KindFile) })
	hive.AddConfigOverride(a.h, func(c *metrics.Config) { c.PrometheusServeAddr = "127.0.0.1:0" })
	hive.AddConfigOverride(a.h, func(c *restoration.Config) { c.IdentityRestoreGracePeriod = grace })
	a.running = testhive.Start(t, a.h)
	select {
	case <-a.r.Ready():
	case <-time.After(time.Minute):
		t.Fatalf("restoration not ready: %+v", a.r.Status())
	}
	return &a
}

func (a *restoringAgent) stop(t *testing.T) {
	t.Helper()
	a.running.Stop()
}

func TestScrapeRestoration(t *testing.T) {
	dir := t.TempDir()

	// The first run leaves two CIDR identities in the checkpoint and
	// their prefixes in the map file.
	a := startRestoringAgent(t, dir, time.Hour)
	metricstest.Expect(t, metricstest.Scrape(t, a.srv.Addr()), map[string]float64{
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
	metricstest.Expect(t, metricstest.Scrape(t, b.srv.Addr()), map[string]float64{
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
	metricstest.Expect(t, metricstest.Scrape(t, b.srv.Addr()), map[string]float64{
		`identityd_identity_restoration{result="released_after_grace"}`: 2,
	})
}
