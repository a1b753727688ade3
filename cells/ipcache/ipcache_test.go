package ipcache_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/ipcachemap"
	"github.com/identityd/identityd/internal/testhive"
	"github.com/identityd/identityd/labels"
)

type node struct {
	ipc     *ipcache.IPCache
	alloc   allocator.Allocator
	hive    *hive.Hive
	running *testhive.Running // set by start
	dir     string
	// allocTimeout, when set before start, is the allocator's
	// --identity-allocation-timeout (hive allows one override per
	// configuration type, and newNode has the allocator's).
	allocTimeout time.Duration
}

// newNode builds a hive with the ipcache on the file backend in a fresh
// state directory. extra cells run in the hive too (e.g. an initializer).
func newNode(t testing.TB, cfg func(*ipcache.Config), extra ...cell.Cell) *node {
	t.Helper()
	n := &node{dir: t.TempDir()}
	cells := []cell.Cell{
		cell.SimpleHealthCell, job.Cell, statedb.Cell, statedir.Cell,
		allocator.Cell, ipcache.Cell,
		cell.Invoke(func(c *ipcache.IPCache, a allocator.Allocator) { n.ipc, n.alloc = c, a }),
	}
	n.hive = hive.New(append(cells, extra...)...)
	hive.AddConfigOverride(n.hive, func(c *statedir.Config) { c.StateDir = n.dir })
	// Remote nodes' label sets get remote-node-scope identities, as the
	// tests expect (Cilium's --policy-cidr-match-mode=nodes).
	hive.AddConfigOverride(n.hive, func(c *allocator.Config) {
		c.PolicyCIDRMatchMode = []string{allocator.PolicyCIDRMatchNodes}
		if n.allocTimeout > 0 {
			c.IdentityAllocationTimeout = n.allocTimeout
		}
	})
	hive.AddConfigOverride(n.hive, func(c *ipcache.Config) {
		c.IPCacheMap = string(ipcachemap.KindFile)
		if cfg != nil {
			cfg(c)
		}
	})
	return n
}

func (n *node) start(t testing.TB) {
	t.Helper()
	log := hivetest.Logger(t)
	if _, bench := t.(*testing.B); bench {
		// Benchmark output is for figures, not start-up logs.
		log = hivetest.Logger(t, hivetest.LogLevel(slog.LevelWarn))
	}
	r, err := testhive.TryStart(t, n.hive, log)
	if err != nil {
		t.Fatal(err)
	}
	n.running = r
}

func startNode(t testing.TB) *node {
	n := newNode(t, nil)
	n.start(t)
	return n
}

func pfx(s string) netip.Prefix { return netip.MustParsePrefix(s) }

func refCount(a allocator.Allocator, id identity.NumericIdentity) int {
	for _, e := range a.List() {
		if e.Identity.ID == id {
			return e.RefCount
		}
	}
	return 0
}

func mustGet(t *testing.T, c *ipcache.IPCache, p string) *ipcache.Entry {
	t.Helper()
	e, ok := c.LookupPrefix(pfx(p))
	if !ok {
		t.Fatalf("no row for %s", p)
	}
	return e
}

func waitMap(t testing.TB, c *ipcache.IPCache) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.WaitForMap(ctx); err != nil {
		t.Fatalf("map did not converge: %v", err)
	}
}

func TestLookupLongestPrefix(t *testing.T) {
	n := startNode(t)
	ctx := t.Context()
	ids := map[string]identity.NumericIdentity{
		"0.0.0.0/0":         100,
		"10.0.0.0/8":        101,
		"10.1.0.0/16":       102,
		"10.1.2.0/24":       103,
		"10.1.2.3/32":       104,
		"::/0":              200,
		"2001:db8::/32":     201,
		"2001:db8:1::/48":   202,
		"2001:db8:1::1/128": 203,
	}
	var updates []ipcache.Update
	for p, id := range ids {
		updates = append(updates, ipcache.Update{Prefix: pfx(p), Info: ipcache.Info{Identity: id}})
	}
	if err := n.ipc.UpsertBatch(ctx, "endpoints", updates); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ addr, want string }{
		{"10.1.2.3", "10.1.2.3/32"},
		{"10.1.2.4", "10.1.2.0/24"},
		{"10.1.3.1", "10.1.0.0/16"},
		{"10.2.0.0", "10.0.0.0/8"},
		{"192.0.2.1", "0.0.0.0/0"},
		{"::ffff:10.1.2.3", "10.1.2.3/32"}, // IPv4-mapped is looked up as IPv4
		{"2001:db8:1::1", "2001:db8:1::1/128"},
		{"2001:db8:1::2", "2001:db8:1::/48"},
		{"2001:db8:2::1", "2001:db8::/32"},
		{"fe80::1", "::/0"},
	} {
		e, ok := n.ipc.Lookup(netip.MustParseAddr(tc.addr))
		if !ok || e.Prefix.String() != tc.want {
			t.Errorf("Lookup(%s) = %v %v, want %s", tc.addr, e, ok, tc.want)
			continue
		}
		if e.Identity != ids[tc.want] || e.Source != ipcache.SourceDirect {
			t.Errorf("Lookup(%s): identity %d source %s", tc.addr, e.Identity, e.Source)
		}
	}

	// Without the default routes, an address of the other family finds
	// nothing.
	if err := n.ipc.Remove(ctx, "endpoints", pfx("0.0.0.0/0"), pfx("::/0")); err != nil {
		t.Fatal(err)
	}
	if e, ok := n.ipc.Lookup(netip.MustParseAddr("192.0.2.1")); ok {
		t.Fatalf("192.0.2.1 matched %s", e.Prefix)
	}

	// The map answers the same way, as the datapath would.
	waitMap(t, n.ipc)
	dump, err := n.ipc.MapDump()
	if err != nil {
		t.Fatal(err)
	}
	if len(dump) != len(ids)-2 {
		t.Fatalf("map has %d entries, want %d", len(dump), len(ids)-2)
	}
}

func TestPrefixNormalization(t *testing.T) {
	n := startNode(t)
	ctx := t.Context()
	// Host bits are masked; an IPv4-mapped prefix is stored as IPv4.
	if err := n.ipc.Upsert(ctx, "a", pfx("10.1.2.3/8"), ipcache.Info{}); err != nil {
		t.Fatal(err)
	}
	if err := n.ipc.Upsert(ctx, "b", pfx("::ffff:10.0.0.0/104"), ipcache.Info{}); err != nil {
		t.Fatal(err)
	}
	e := mustGet(t, n.ipc, "10.0.0.0/8")
	if len(e.Owners) != 2 || e.Labels.String() != "cidr:10.0.0.0/8,reserved:world" {
		t.Fatalf("row %+v", e)
	}
	for _, bad := range []netip.Prefix{{}, pfx("::ffff:0.0.0.0/80")} {
		if err := n.ipc.Upsert(ctx, "a", bad, ipcache.Info{}); !errors.Is(err, ipcache.ErrInvalidPrefix) {
			t.Errorf("Upsert(%v) = %v, want ErrInvalidPrefix", bad, err)
		}
	}
}

func TestMetadataMergeAndRelease(t *testing.T) {
	n := startNode(t)
	ctx := t.Context()
	p := pfx("192.168.1.10/32")

	if err := n.ipc.Upsert(ctx, "cidr-policy", p, ipcache.Info{}); err != nil {
		t.Fatal(err)
	}
	first := mustGet(t, n.ipc, "192.168.1.10/32")
	if !first.Labels.Equal(labels.FromPrefix(p, false)) || !first.Identity.HasLocalScope() {
		t.Fatalf("plain CIDR row: %v %v", first.Identity, first.Labels)
	}
	if refCount(n.alloc, first.Identity) != 1 {
		t.Fatalf("refcount %d, want 1", refCount(n.alloc, first.Identity))
	}

	// A second owner without labels: same identity, still one reference.
	if err := n.ipc.Upsert(ctx, "fqdn", p, ipcache.Info{}); err != nil {
		t.Fatal(err)
	}
	if e := mustGet(t, n.ipc, "192.168.1.10/32"); e.Identity != first.Identity || refCount(n.alloc, e.Identity) != 1 {
		t.Fatalf("second owner: identity %d refcount %d", e.Identity, refCount(n.alloc, e.Identity))
	}

	// An owner adds reserved:remote-node: the merged labels change, the
	// identity moves to the remote-node scope and the old one is released.
	if err := n.ipc.Upsert(ctx, "node-manager", p, ipcache.Info{Labels: labels.MustParse("reserved:remote-node")}); err != nil {
		t.Fatal(err)
	}
	moved := mustGet(t, n.ipc, "192.168.1.10/32")
	if moved.Identity.Scope() != identity.ScopeRemoteNode || moved.Labels.String() != "cidr:192.168.1.10/32,reserved:remote-node" {
		t.Fatalf("after remote-node label: %d %s", moved.Identity, moved.Labels)
	}
	if n.alloc.LookupByID(first.Identity) != nil {
		t.Fatalf("old identity %d still allocated", first.Identity)
	}
	if refCount(n.alloc, moved.Identity) != 1 {
		t.Fatalf("refcount of new identity %d", refCount(n.alloc, moved.Identity))
	}

	// Conflicting labels (same key): the greater owner wins regardless of
	// the order of the upserts.
	q := pfx("10.9.0.0/16")
	if err := n.ipc.Upsert(ctx, "z-owner", q, ipcache.Info{Labels: labels.MustParse("fqdn:tier=z")}); err != nil {
		t.Fatal(err)
	}
	if err := n.ipc.Upsert(ctx, "a-owner", q, ipcache.Info{Labels: labels.MustParse("fqdn:tier=a")}); err != nil {
		t.Fatal(err)
	}
	if got := mustGet(t, n.ipc, "10.9.0.0/16").Labels.String(); got != "cidr:10.9.0.0/16,fqdn:tier=z,reserved:world" {
		t.Fatalf("merged labels %s", got)
	}

	// Owners leave one by one; the identity goes with the last.
	for _, o := range []ipcache.ResourceID{"cidr-policy", "node-manager"} {
		if err := n.ipc.Remove(ctx, o, p); err != nil {
			t.Fatal(err)
		}
	}
	last := mustGet(t, n.ipc, "192.168.1.10/32")
	if last.Identity.Scope() != identity.ScopeLocal || n.alloc.LookupByID(moved.Identity) != nil {
		t.Fatalf("after node-manager left: %d, remote-node identity still there: %v", last.Identity, n.alloc.LookupByID(moved.Identity) != nil)
	}
	if err := n.ipc.Remove(ctx, "fqdn", p); err != nil {
		t.Fatal(err)
	}
	if _, ok := n.ipc.LookupPrefix(p); ok {
		t.Fatal("row survived its last owner")
	}
	if n.alloc.LookupByID(last.Identity) != nil || refCount(n.alloc, last.Identity) != 0 {
		t.Fatalf("identity %d not released", last.Identity)
	}
	// Removing what is not there is a no-op.
	if err := n.ipc.Remove(ctx, "fqdn", p); err != nil {
		t.Fatal(err)
	}
}

func TestRequestedID(t *testing.T) {
	n := startNode(t)
	ctx := t.Context()
	want := identity.NumericIdentity(0x01000000 | 4242)

	// Labels unknown: the requested ID is honoured.
	if err := n.ipc.Upsert(ctx, "restored", pfx("192.0.2.0/24"), ipcache.Info{RequestedID: want}); err != nil {
		t.Fatal(err)
	}
	if got := mustGet(t, n.ipc, "192.0.2.0/24").Identity; got != want {
		t.Fatalf("requested %d, got %d", want, got)
	}
	// Another owner without labels keeps it (same label set, same reference).
	if err := n.ipc.Upsert(ctx, "k8s", pfx("192.0.2.0/24"), ipcache.Info{}); err != nil {
		t.Fatal(err)
	}
	if got := mustGet(t, n.ipc, "192.0.2.0/24").Identity; got != want || refCount(n.alloc, want) != 1 {
		t.Fatalf("after second owner: %d refcount %d", got, refCount(n.alloc, want))
	}
	// Restoration's owner leaves: the identity stays, the k8s owner holds
	// the prefix.
	if _, err := n.ipc.RemoveOwner(ctx, "restored"); err != nil {
		t.Fatal(err)
	}
	if got := mustGet(t, n.ipc, "192.0.2.0/24").Identity; got != want {
		t.Fatalf("after restored left: %d", got)
	}

	// Owners that give labels decide: the requested ID is ignored.
	other := identity.NumericIdentity(0x01000000 | 4343)
	if err := n.ipc.Upsert(ctx, "restored", pfx("198.51.100.0/24"), ipcache.Info{RequestedID: other}); err != nil {
		t.Fatal(err)
	}
	if err := n.ipc.Upsert(ctx, "kube", pfx("198.51.100.0/24"), ipcache.Info{Labels: labels.MustParse("reserved:ingress")}); err != nil {
		t.Fatal(err)
	}
	e := mustGet(t, n.ipc, "198.51.100.0/24")
	if e.Labels.String() != "cidr:198.51.100.0/24,reserved:ingress" || e.Identity == other {
		t.Fatalf("labels and requested ID: %d %s", e.Identity, e.Labels)
	}
	if n.alloc.LookupByID(other) != nil {
		t.Fatalf("requested identity %d still held after the labels took over", other)
	}

	// A requested ID outside the scope is not honoured, but the prefix
	// still gets an identity.
	if err := n.ipc.Upsert(ctx, "restored", pfx("203.0.113.0/24"), ipcache.Info{RequestedID: 300}); err != nil {
		t.Fatal(err)
	}
	if got := mustGet(t, n.ipc, "203.0.113.0/24").Identity; !got.HasLocalScope() {
		t.Fatalf("out-of-scope request gave %d", got)
	}
}

func TestDirectPrecedence(t *testing.T) {
	n := startNode(t)
	ctx := t.Context()
	p := pfx("10.2.0.5/32")

	if err := n.ipc.Upsert(ctx, "cidr", p, ipcache.Info{}); err != nil {
		t.Fatal(err)
	}
	meta := mustGet(t, n.ipc, "10.2.0.5/32").Identity

	// A direct identity wins and the metadata's reference is dropped.
	tep := netip.MustParseAddr("172.16.0.1")
	if err := n.ipc.Upsert(ctx, "ep1", p, ipcache.Info{Identity: 5000, TunnelEndpoint: tep, EncryptKey: 3}); err != nil {
		t.Fatal(err)
	}
	e := mustGet(t, n.ipc, "10.2.0.5/32")
	if e.Identity != 5000 || e.Source != ipcache.SourceDirect || e.TunnelEndpoint != tep || e.EncryptKey != 3 {
		t.Fatalf("direct row %+v", e)
	}
	if n.alloc.LookupByID(meta) != nil {
		t.Fatalf("metadata identity %d still held under a direct identity", meta)
	}

	// The latest direct upsert wins; removing it falls back to the older.
	if err := n.ipc.Upsert(ctx, "ep0", p, ipcache.Info{Identity: 6000}); err != nil {
		t.Fatal(err)
	}
	if got := mustGet(t, n.ipc, "10.2.0.5/32").Identity; got != 6000 {
		t.Fatalf("latest direct: %d", got)
	}
	if err := n.ipc.Remove(ctx, "ep0", p); err != nil {
		t.Fatal(err)
	}
	if got := mustGet(t, n.ipc, "10.2.0.5/32").Identity; got != 5000 {
		t.Fatalf("fallback direct: %d", got)
	}

	// The map carries the tunnel endpoint and key.
	waitMap(t, n.ipc)
	dump, err := n.ipc.MapDump()
	if err != nil {
		t.Fatal(err)
	}
	if len(dump) != 1 || dump[0].Value != (ipcache.MapValue{Identity: 5000, TunnelEndpoint: tep, EncryptKey: 3}) {
		t.Fatalf("map %+v", dump)
	}

	// Without direct identities the metadata is resolved again.
	if err := n.ipc.Remove(ctx, "ep1", p); err != nil {
		t.Fatal(err)
	}
	e = mustGet(t, n.ipc, "10.2.0.5/32")
	if e.Source != ipcache.SourceMetadata || !e.Identity.HasLocalScope() || refCount(n.alloc, e.Identity) != 1 {
		t.Fatalf("back to metadata: %+v", e)
	}

	// Invalid infos are refused.
	for _, bad := range []ipcache.Info{
		{Identity: 1, Labels: labels.MustParse("k8s:a=b")},
		{Identity: 1, RequestedID: 2},
		{Identity: 1, TunnelEndpoint: netip.MustParseAddr("fd00::1")},
		{TunnelEndpoint: tep},
	} {
		if err := n.ipc.Upsert(ctx, "x", p, bad); !errors.Is(err, ipcache.ErrInvalidInfo) {
			t.Errorf("Upsert(%+v) = %v, want ErrInvalidInfo", bad, err)
		}
	}
}

func TestBatchPartialFailure(t *testing.T) {
	n := startNode(t)
	ctx := t.Context()
	err := n.ipc.UpsertBatch(ctx, "o", []ipcache.Update{
		{Prefix: pfx("10.0.0.0/24")},
		{Prefix: netip.Prefix{}},
		// A global label set needs the kvstore, which this hive lacks.
		{Prefix: pfx("10.0.1.0/24"), Info: ipcache.Info{Labels: labels.MustParse("k8s:app=web")}},
		{Prefix: pfx("10.0.2.0/24")},
		// Duplicates: the last one wins.
		{Prefix: pfx("10.0.2.0/24"), Info: ipcache.Info{Identity: 777}},
	})
	if !errors.Is(err, ipcache.ErrInvalidPrefix) || !errors.Is(err, allocator.ErrNoGlobalBackend) {
		t.Fatalf("batch error %v", err)
	}
	if _, ok := n.ipc.LookupPrefix(pfx("10.0.1.0/24")); ok {
		t.Fatal("failed allocation left a row")
	}
	mustGet(t, n.ipc, "10.0.0.0/24")
	if got := mustGet(t, n.ipc, "10.0.2.0/24").Identity; got != 777 {
		t.Fatalf("duplicate in batch: %d", got)
	}

	// A failed change of an existing row leaves the row as it was.
	before := mustGet(t, n.ipc, "10.0.0.0/24")
	err = n.ipc.Upsert(ctx, "o", pfx("10.0.0.0/24"), ipcache.Info{Labels: labels.MustParse("k8s:app=web")})
	if !errors.Is(err, allocator.ErrNoGlobalBackend) {
		t.Fatalf("upsert error %v", err)
	}
	after := mustGet(t, n.ipc, "10.0.0.0/24")
	if after.Identity != before.Identity || refCount(n.alloc, after.Identity) != 1 {
		t.Fatalf("failed upsert changed the row: %d -> %d", before.Identity, after.Identity)
	}
}

func TestRemoveOwner(t *testing.T) {
	n := startNode(t)
	ctx := t.Context()
	var restored, other []ipcache.Update
	for i := range 2000 {
		p := netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 8), byte(i), 0}), 24)
		restored = append(restored, ipcache.Update{Prefix: p})
		if i%2 == 0 {
			other = append(other, ipcache.Update{Prefix: p})
		}
	}
	if err := n.ipc.UpsertBatch(ctx, "restored", restored); err != nil {
		t.Fatal(err)
	}
	if err := n.ipc.UpsertBatch(ctx, "k8s", other); err != nil {
		t.Fatal(err)
	}
	if got := len(n.ipc.ListOwner("restored")); got != 2000 {
		t.Fatalf("restored owns %d rows", got)
	}
	removed, err := n.ipc.RemoveOwner(ctx, "restored")
	if err != nil || removed != 2000 {
		t.Fatalf("RemoveOwner = %d, %v", removed, err)
	}
	if got := len(n.ipc.List()); got != 1000 {
		t.Fatalf("%d rows left, want the 1000 that k8s owns", got)
	}
	if got := len(n.alloc.LocalIdentities()); got != 1000 {
		t.Fatalf("%d local identities left, want 1000", got)
	}
	if _, err := n.ipc.RemoveOwner(ctx, "k8s"); err != nil {
		t.Fatal(err)
	}
	if got := len(n.alloc.LocalIdentities()); got != 0 {
		t.Fatalf("%d local identities left after every owner left", got)
	}
	waitMap(t, n.ipc)
	if dump, _ := n.ipc.MapDump(); len(dump) != 0 {
		t.Fatalf("map holds %d entries", len(dump))
	}
}

func TestConcurrentOwners(t *testing.T) {
	n := startNode(t)
	ctx := t.Context()
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			owner := ipcache.ResourceID(fmt.Sprintf("owner-%d", w))
			for i := range 200 {
				p := netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 0, byte(i), 0}), 24)
				info := ipcache.Info{}
				if i%3 == w%3 {
					info.Labels = labels.MustParse("reserved:remote-node")
				}
				if err := n.ipc.Upsert(ctx, owner, p, info); err != nil {
					t.Error(err)
					return
				}
				if i%5 == 0 {
					if err := n.ipc.Remove(ctx, owner, p); err != nil {
						t.Error(err)
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	// One reference per row, whatever the interleaving.
	for _, e := range n.ipc.List() {
		if rc := refCount(n.alloc, e.Identity); rc != 1 {
			t.Fatalf("%s: identity %d has refcount %d", e.Prefix, e.Identity, rc)
		}
	}
	for w := range 4 {
		if _, err := n.ipc.RemoveOwner(ctx, ipcache.ResourceID(fmt.Sprintf("owner-%d", w))); err != nil {
			t.Fatal(err)
		}
	}
	if got := len(n.alloc.LocalIdentities()); got != 0 {
		t.Fatalf("%d local identities leaked", got)
	}
}

// TestPruneWaitsForInitializer writes a stale entry into the map file
// before the hive starts; an initializer registered from a constructor (as
// restoration does) keeps it in the map until it is done.
func TestPruneWaitsForInitializer(t *testing.T) {
	var done func()
	n := newNode(t, nil, cell.Invoke(func(c *ipcache.IPCache) { done = c.RegisterInitializer("restoration") }))
	file := filepath.Join(n.dir, ipcachemap.FileName)
	stale := ipcachemap.Entry{Key: ipcachemap.Key{Prefix: pfx("192.0.2.0/24")}, Value: ipcachemap.Value{Identity: 16777300}}
	writeMapFile(t, file, stale)
	n.start(t)

	// The snapshot is the stale entry, in the ipcache's own types.
	want := ipcache.MapEntry{Key: ipcache.MapKey{Prefix: pfx("192.0.2.0/24")}, Value: ipcache.MapValue{Identity: 16777300}}
	if snap := n.ipc.TakeSnapshot(); len(snap) != 1 || snap[0] != want {
		t.Fatalf("snapshot %+v", snap)
	}
	if snap := n.ipc.TakeSnapshot(); snap != nil {
		t.Fatalf("second snapshot %+v", snap)
	}

	if err := n.ipc.Upsert(t.Context(), "k8s", pfx("10.0.0.0/8"), ipcache.Info{}); err != nil {
		t.Fatal(err)
	}
	waitMap(t, n.ipc)
	// Give a premature prune every chance to happen.
	time.Sleep(50 * time.Millisecond)
	if dump, _ := n.ipc.MapDump(); len(dump) != 2 {
		t.Fatalf("before initialization the map holds %+v, want the stale entry and the new one", dump)
	}
	if ok, _ := n.ipc.Initialized(); ok {
		t.Fatal("table initialized with an initializer pending")
	}

	done()
	_, initialized := n.ipc.Initialized()
	<-initialized
	deadline := time.Now().Add(10 * time.Second)
	for {
		dump, _ := n.ipc.MapDump()
		if len(dump) == 1 && dump[0].Key.Prefix == pfx("10.0.0.0/8") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("stale entry not pruned: %+v", dump)
		}
		time.Sleep(5 * time.Millisecond)
	}

	// On stop the file holds the table.
	n.running.Stop()
	m, info, err := ipcachemap.Open(ipcachemap.Config{Kind: ipcachemap.KindFile, FilePath: file})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if len(info.Snapshot) != 1 || info.Snapshot[0].Key.Prefix != pfx("10.0.0.0/8") {
		t.Fatalf("map file after stop: %+v", info.Snapshot)
	}
}

// TestNoWritesBeforeStartHooksEnd checks that the reconciler leaves the
// map alone while restoration's start hook runs, even when rows are
// upserted from it: the ipcache waits for the restoration registered with
// the allocator (Allocator.WaitForRestoration), here a stand-in that is
// done when its hook ends.
func TestNoWritesBeforeStartHooksEnd(t *testing.T) {
	var sawMap []ipcache.MapEntry
	done := make(chan struct{})
	later := cell.Group(
		cell.Provide(func() allocator.RestorationOut { return allocator.NewRestoration(standInRestoration(done)) }),
		cell.Invoke(func(lc cell.Lifecycle, c *ipcache.IPCache) {
			lc.Append(cell.Hook{OnStart: func(cell.HookContext) error {
				defer close(done)
				if err := c.Upsert(allocator.Restoring(t.Context()), "restored", pfx("10.0.0.0/8"), ipcache.Info{}); err != nil {
					return err
				}
				time.Sleep(50 * time.Millisecond)
				var err error
				sawMap, err = c.MapDump()
				return err
			}})
		}),
	)
	n := newNode(t, nil, later)
	n.start(t)
	if len(sawMap) != 0 {
		t.Fatalf("the map was written during start hooks: %+v", sawMap)
	}
	waitMap(t, n.ipc)
	if dump, _ := n.ipc.MapDump(); len(dump) != 1 {
		t.Fatalf("after start the map holds %+v", dump)
	}
}

func writeMapFile(t testing.TB, file string, entries ...ipcachemap.Entry) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(file), 0o700); err != nil {
		t.Fatal(err)
	}
	m, _, err := ipcachemap.Open(ipcachemap.Config{Kind: ipcachemap.KindFile, FilePath: file})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.UpdateBatch(entries); err != nil {
		t.Fatal(err)
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
}

// TestBadInput checks the Go API refuses what the shell refuses: a
// direct identity or requested ID outside the identity space, and owners
// that cannot be named; the table stays as it was.
func TestBadInput(t *testing.T) {
	n := startNode(t)
	ctx := t.Context()
	for _, tc := range []struct {
		owner ipcache.ResourceID
		info  ipcache.Info
		want  error
	}{
		{"ep", ipcache.Info{Identity: 4294967295}, identity.ErrInvalidNumericIdentity},
		{"ep", ipcache.Info{Identity: 0x01000000}, identity.ErrInvalidNumericIdentity},
		{"ep", ipcache.Info{Identity: 0x03000001}, identity.ErrInvalidNumericIdentity},
		{"ep", ipcache.Info{RequestedID: 0xFF000001}, identity.ErrInvalidNumericIdentity},
		{"", ipcache.Info{}, ipcache.ErrInvalidOwner},
		{"a\nb", ipcache.Info{}, ipcache.ErrInvalidOwner},
		{"a\xffb", ipcache.Info{}, ipcache.ErrInvalidOwner},
	} {
		err := n.ipc.Upsert(ctx, tc.owner, pfx("10.0.0.0/8"), tc.info)
		if !errors.Is(err, tc.want) {
			t.Errorf("Upsert(%q, %+v) = %v, want %v", tc.owner, tc.info, err, tc.want)
		}
	}
	if _, err := n.ipc.RemoveOwner(ctx, ""); !errors.Is(err, ipcache.ErrInvalidOwner) {
		t.Errorf("RemoveOwner(\"\") = %v", err)
	}
	if err := n.ipc.Remove(ctx, "", pfx("10.0.0.0/8")); !errors.Is(err, ipcache.ErrInvalidOwner) {
		t.Errorf("Remove(\"\") = %v", err)
	}
	if rows := n.ipc.List(); len(rows) != 0 {
		t.Fatalf("refused input reached the table: %+v", rows)
	}
	// The edges of the valid ranges pass.
	for _, id := range []identity.NumericIdentity{1, 0xFFFFFF, 0x01000001, 0x02FFFFFF} {
		if err := n.ipc.Upsert(ctx, "ep", pfx("10.0.0.0/8"), ipcache.Info{Identity: id}); err != nil {
			t.Errorf("identity %d refused: %v", id, err)
		}
	}
}

func TestConfigValidation(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  func(*ipcache.Config)
		want string
	}{
		{"bad kind", func(c *ipcache.Config) { c.IPCacheMap = "hash" }, "invalid --ipcache-map"},
		{"zero entries", func(c *ipcache.Config) { c.IPCacheMapMaxEntries = 0 }, "invalid --ipcache-map-max-entries"},
		{"too many entries", func(c *ipcache.Config) { c.IPCacheMapMaxEntries = ipcache.MaxMapEntries + 1 }, "invalid --ipcache-map-max-entries"},
		{"no pin path", func(c *ipcache.Config) { c.IPCacheMap = "bpf"; c.IPCacheMapPinPath = "" }, "pin-path"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := newNode(t, tc.cfg)
			_, err := testhive.TryStart(t, n.hive, nil)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("start error %v, want one containing %q", err, tc.want)
			}
		})
	}
	// A million entries is a valid size.
	n := newNode(t, func(c *ipcache.Config) { c.IPCacheMapMaxEntries = 1_000_000 })
	n.start(t)
}

// standInRestoration is an allocator.Restoration that is done when its
// channel is closed.
type standInRestoration chan struct{}

func (r standInRestoration) Done() <-chan struct{} { return r }
