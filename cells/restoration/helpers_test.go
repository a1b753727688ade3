package restoration_test

import (
	"context"
	"log/slog"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/checkpoint"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/cells/restoration"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/ipcachemap"
	"github.com/identityd/identityd/internal/testhive"
	"github.com/identityd/identityd/labels"
)

// agent is a hive with the cells restoration works with, on a state
// directory that outlives it, with the file map backend.
type agent struct {
	h       *hive.Hive
	running *testhive.Running // nil until start
	log     *slog.Logger
	alloc   allocator.Allocator
	ipc     *ipcache.IPCache
	r       *restoration.Restorer
	cp      *checkpoint.Checkpoint
}

// newAgent builds the hive; extra cells are appended after restoration.Cell
// unless before is set.
func newAgent(tb testing.TB, dir string, grace time.Duration, log *slog.Logger, extra ...cell.Cell) *agent {
	// Remote nodes' label sets get remote-node-scope identities, as the
	// tests expect (Cilium's --policy-cidr-match-mode=nodes).
	nodes := func(c *allocator.Config) { c.PolicyCIDRMatchMode = []string{allocator.PolicyCIDRMatchNodes} }
	return newAgentWith(tb, dir, grace, log, nodes, extra...)
}

// newAgentWith is newAgent with the allocator's configuration set by cfg.
func newAgentWith(tb testing.TB, dir string, grace time.Duration, log *slog.Logger, cfg func(*allocator.Config), extra ...cell.Cell) *agent {
	a := &agent{log: log}
	if a.log == nil {
		a.log = hivetest.Logger(tb)
	}
	cells := []cell.Cell{
		cell.SimpleHealthCell, job.Cell, statedb.Cell, statedir.Cell,
		allocator.Cell, checkpoint.Cell, ipcache.Cell, restoration.Cell,
	}
	cells = append(cells, extra...)
	cells = append(cells, cell.Invoke(func(al allocator.Allocator, ipc *ipcache.IPCache, r *restoration.Restorer, cp *checkpoint.Checkpoint) {
		a.alloc, a.ipc, a.r, a.cp = al, ipc, r, cp
	}))
	a.h = hive.New(cells...)
	hive.AddConfigOverride(a.h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(a.h, cfg)
	// Never the real pinned map: each test has its own file.
	hive.AddConfigOverride(a.h, func(c *ipcache.Config) { c.IPCacheMap = string(ipcachemap.KindFile) })
	hive.AddConfigOverride(a.h, func(c *checkpoint.Config) { c.IdentityCheckpointInterval = time.Hour })
	hive.AddConfigOverride(a.h, func(c *restoration.Config) { c.IdentityRestoreGracePeriod = grace })
	return a
}

// start starts the hive, which stops at stop or when the test ends, and
// waits for restoration to be ready.
func (a *agent) start(tb testing.TB) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	r, err := testhive.TryStart(tb, a.h, a.log)
	if err != nil {
		tb.Fatalf("start: %s", err)
	}
	a.running = r
	select {
	case <-a.r.Ready():
	case <-ctx.Done():
		tb.Fatalf("restoration not ready: %+v", a.r.Status())
	}
}

// stop stops the hive; a second stop does nothing.
func (a *agent) stop(tb testing.TB) {
	tb.Helper()
	if a.running != nil {
		a.running.Stop()
		return
	}
	// A hive started without start, as the benchmark's.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := a.h.Stop(a.log, ctx); err != nil {
		tb.Fatalf("stop: %s", err)
	}
}

// mapPairs waits until the map holds the table and returns it as
// prefix -> identity.
func (a *agent) mapPairs(tb testing.TB) map[netip.Prefix]identity.NumericIdentity {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := a.ipc.WaitForMap(ctx); err != nil {
		tb.Fatalf("wait for map: %s", err)
	}
	entries, err := a.ipc.MapDump()
	if err != nil {
		tb.Fatalf("map dump: %s", err)
	}
	out := make(map[netip.Prefix]identity.NumericIdentity, len(entries))
	for _, e := range entries {
		out[e.Key.Prefix] = e.Value.Identity
	}
	return out
}

// waitMap polls the map until it equals want, for a while, and returns its
// last contents.
func (a *agent) waitMap(tb testing.TB, want map[netip.Prefix]identity.NumericIdentity) map[netip.Prefix]identity.NumericIdentity {
	tb.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := a.mapPairs(tb)
		if equalMaps(got, want) || time.Now().After(deadline) {
			return got
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// localIDs returns the allocator's local identities by canonical labels.
func (a *agent) localIDs() map[string]identity.NumericIdentity {
	out := map[string]identity.NumericIdentity{}
	for _, id := range a.alloc.LocalIdentities() {
		out[id.Labels.Canonical()] = id.ID
	}
	return out
}

// waitReleased waits for the grace-period job's release.
func (a *agent) waitReleased(tb testing.TB) {
	tb.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for a.r.Status().State != restoration.StateReleased {
		if time.Now().After(deadline) {
			tb.Fatalf("restored state not released: %+v", a.r.Status())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func prefixes(n int) []netip.Prefix {
	out := make([]netip.Prefix, 0, n)
	for i := range n {
		if i%5 == 4 {
			a := netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 14: byte(i >> 8), 15: byte(i)})
			out = append(out, netip.PrefixFrom(a, 128))
			continue
		}
		a := netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})
		out = append(out, netip.PrefixFrom(a, 32))
	}
	return out
}

func writeMap(tb testing.TB, dir string, entries []ipcachemap.Entry) {
	tb.Helper()
	m, _, err := ipcachemap.Open(ipcachemap.Config{Kind: ipcachemap.KindFile, FilePath: dir + "/" + ipcachemap.FileName})
	if err != nil {
		tb.Fatal(err)
	}
	if err := m.UpdateBatch(entries); err != nil {
		tb.Fatal(err)
	}
	if err := m.Close(); err != nil {
		tb.Fatal(err)
	}
}

func mustLabels(s ...string) labels.Labels { return labels.MustParse(s...) }

func labelsOf(p netip.Prefix) labels.Labels { return labels.FromPrefix(p, false) }
