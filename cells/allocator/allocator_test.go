package allocator

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/identityd/identityd/internal/eventually"

	"github.com/cilium/hive/hivetest"
	"github.com/cilium/statedb"
	"go.uber.org/goleak"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// testAllocator returns a started allocator without a global backend,
// with local scopes of maxLocal IDs each.
func testAllocator(t testing.TB, maxLocal identity.NumericIdentity, handlers ...Handler) (*identityAllocator, *statedb.DB, statedb.RWTable[Entry]) {
	t.Helper()
	return testAllocatorWith(t, nodesConfig(), maxLocal, handlers...)
}

// nodesConfig is DefaultConfig with --policy-cidr-match-mode=nodes, under
// which remote nodes' label sets get remote-node-scope identities.
func nodesConfig() Config {
	cfg := DefaultConfig
	cfg.PolicyCIDRMatchMode = []string{PolicyCIDRMatchNodes}
	return cfg
}

// testAllocatorWith is testAllocator with the given configuration.
func testAllocatorWith(t testing.TB, cfg Config, maxLocal identity.NumericIdentity, handlers ...Handler) (*identityAllocator, *statedb.DB, statedb.RWTable[Entry]) {
	t.Helper()
	db := statedb.New()
	table, err := NewTable(db)
	if err != nil {
		t.Fatal(err)
	}
	var log *slog.Logger
	if tt, ok := t.(*testing.T); ok {
		log = hivetest.Logger(tt)
	} else {
		log = slog.New(slog.DiscardHandler)
	}
	a := newIdentityAllocator(cfg, log, db, table, nil, handlers, maxLocal)
	if err := a.startStandalone(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.stopStandalone(context.Background()) })
	return a, db, table
}

func cidr(s string) labels.Labels { return labels.FromPrefix(netip.MustParsePrefix(s), false) }

func remoteNode(ip string) labels.Labels {
	return labels.MustNew(labels.Label{Source: labels.SourceCIDR, Key: ip + "/32"}, labels.LabelRemoteNode)
}

func mustAlloc(t testing.TB, a Allocator, lbls labels.Labels, opts ...AllocateOption) (*identity.Identity, bool) {
	t.Helper()
	id, allocated, err := a.Allocate(context.Background(), lbls, opts...)
	if err != nil {
		t.Fatalf("allocate %s: %s", lbls, err)
	}
	return id, allocated
}

func TestLocalSequentialAndRefcounts(t *testing.T) {
	a, _, _ := testAllocator(t, identity.MaxLocalIdentity)

	id1, new1 := mustAlloc(t, a, cidr("10.0.0.0/8"))
	if !new1 || id1.ID != 16777217 {
		t.Fatalf("first CIDR identity = %d (new %v), want 16777217 new", id1.ID, new1)
	}
	id2, _ := mustAlloc(t, a, cidr("10.1.0.0/16"))
	if id2.ID != 16777218 {
		t.Fatalf("second CIDR identity = %d, want 16777218", id2.ID)
	}
	rn, _ := mustAlloc(t, a, remoteNode("192.168.1.10"))
	if rn.ID != 33554433 {
		t.Fatalf("first remote-node identity = %d, want 33554433", rn.ID)
	}

	again, newAgain := mustAlloc(t, a, cidr("10.0.0.0/8"))
	if newAgain || again.ID != id1.ID {
		t.Fatalf("second allocation = %d new %v, want %d existing", again.ID, newAgain, id1.ID)
	}
	if got := a.LookupByLabels(cidr("10.0.0.0/8")); got == nil || got.ID != id1.ID {
		t.Fatalf("LookupByLabels = %v", got)
	}
	if got := a.LookupByID(id1.ID); got == nil || !got.Labels.Equal(cidr("10.0.0.0/8")) {
		t.Fatalf("LookupByID = %v", got)
	}

	// Two references: the first release keeps it, the second frees it.
	if released, err := a.Release(context.Background(), id1); err != nil || released {
		t.Fatalf("first release = %v, %v; want kept", released, err)
	}
	if released, err := a.Release(context.Background(), id1); err != nil || !released {
		t.Fatalf("second release = %v, %v; want released", released, err)
	}
	if a.LookupByID(id1.ID) != nil || a.LookupByLabels(cidr("10.0.0.0/8")) != nil {
		t.Fatal("released identity still found")
	}
	if _, err := a.Release(context.Background(), id1); !errors.Is(err, ErrUnknownIdentity) {
		t.Fatalf("release of a released identity: %v, want ErrUnknownIdentity", err)
	}
	// Numbering goes on sequentially rather than reusing at once.
	id3, _ := mustAlloc(t, a, cidr("10.2.0.0/16"))
	if id3.ID != 16777219 {
		t.Fatalf("third CIDR identity = %d, want 16777219", id3.ID)
	}
}

func TestReservedNoOps(t *testing.T) {
	// Cilium's default --policy-cidr-match-mode, under which the reserved
	// remote-node and kube-apiserver sets are reserved.
	a, _, _ := testAllocatorWith(t, DefaultConfig, identity.MaxLocalIdentity)
	for _, r := range identity.ReservedIdentities() {
		id, allocated := mustAlloc(t, a, r.Labels)
		if allocated || id.ID != r.ID {
			t.Fatalf("allocate %s = %d new %v, want %d existing", r.Labels, id.ID, allocated, r.ID)
		}
		if released, err := a.Release(context.Background(), id); err != nil || released {
			t.Fatalf("release of reserved %d = %v, %v", r.ID, released, err)
		}
		if got := a.LookupByID(r.ID); got != r {
			t.Fatalf("LookupByID(%d) = %v", r.ID, got)
		}
	}
	if len(a.LocalIdentities()) != 0 {
		t.Fatal("reserved allocations created local identities")
	}
}

// TestPolicyCIDRMatchMode checks both settings of Cilium's
// --policy-cidr-match-mode: without "nodes" a remote node's label set is
// the reserved 6 (7 with reserved:kube-apiserver) with the caller's labels;
// with "nodes" it gets a remote-node-scope identity.
func TestPolicyCIDRMatchMode(t *testing.T) {
	kas := labels.Merge(remoteNode("10.1.0.1"), labels.MustNew(labels.Reserved(labels.IDNameKubeAPIServer)))
	t.Run("default", func(t *testing.T) {
		a, _, _ := testAllocatorWith(t, DefaultConfig, identity.MaxLocalIdentity)
		for _, tc := range []struct {
			ls labels.Labels
			id identity.NumericIdentity
		}{{remoteNode("192.168.1.10"), 6}, {kas, 7}, {labels.MustNew(labels.LabelRemoteNode), 6}} {
			id, allocated := mustAlloc(t, a, tc.ls)
			if allocated || id.ID != tc.id || !id.Labels.Equal(tc.ls) {
				t.Errorf("allocate %s = %s new %v, want %d with the same labels", tc.ls, id, allocated, tc.id)
			}
			if got := a.LookupByLabels(tc.ls); got == nil || got.ID != tc.id || !got.Labels.Equal(tc.ls) {
				t.Errorf("LookupByLabels(%s) = %v", tc.ls, got)
			}
		}
		if n := len(a.LocalIdentities()); n != 0 {
			t.Errorf("%d local identities, want none", n)
		}
		if got := a.LookupByID(6); got != identity.LookupReservedByID(6) {
			t.Errorf("LookupByID(6) = %v, want the reserved definition", got)
		}
	})
	t.Run("nodes", func(t *testing.T) {
		a, _, _ := testAllocator(t, identity.MaxLocalIdentity)
		for i, ls := range []labels.Labels{remoteNode("192.168.1.10"), kas, labels.MustNew(labels.LabelRemoteNode)} {
			id, allocated := mustAlloc(t, a, ls)
			if want := identity.NumericIdentity(identity.ScopeRemoteNode) + 1 + identity.NumericIdentity(i); !allocated || id.ID != want {
				t.Errorf("allocate %s = %s new %v, want new %d", ls, id, allocated, want)
			}
		}
	})
}

// TestHostKeepsLabels checks that the host with other labels is identity 1
// with the caller's labels, as in Cilium, in both modes.
func TestHostKeepsLabels(t *testing.T) {
	ls := labels.MustParse("reserved:host", "k8s:node-role=worker", "reserved:remote-node")
	for _, cfg := range []Config{DefaultConfig, nodesConfig()} {
		a, _, _ := testAllocatorWith(t, cfg, identity.MaxLocalIdentity)
		id, allocated := mustAlloc(t, a, ls)
		if allocated || id.ID != identity.ReservedIdentityHost || !id.Labels.Equal(ls) {
			t.Errorf("mode %v: allocate %s = %s new %v, want 1 with the same labels", cfg.PolicyCIDRMatchMode, ls, id, allocated)
		}
	}
}

// TestWellKnownIdentities checks --enable-well-known-identities: on, the
// kube-dns set is 102 without allocation and 100..115 are known by ID and
// listed; off, the set is global and 102 is unknown.
func TestWellKnownIdentities(t *testing.T) {
	dns := labels.MustParse("k8s:k8s-app=kube-dns", "k8s:io.kubernetes.pod.namespace=kube-system",
		"k8s:io.cilium.k8s.policy.serviceaccount=kube-dns", "k8s:io.cilium.k8s.policy.cluster=c1")
	cfg := DefaultConfig
	cfg.ClusterName = "c1"
	cfg.EnableWellKnownIdentities = true
	a, _, _ := testAllocatorWith(t, cfg, identity.MaxLocalIdentity)
	id, allocated := mustAlloc(t, a, dns)
	if allocated || id.ID != identity.WellKnownKubeDNS || !id.Labels.Equal(dns) {
		t.Fatalf("allocate kube-dns = %s new %v, want 102", id, allocated)
	}
	if released, err := a.Release(context.Background(), id); released || err != nil {
		t.Errorf("release of 102 = %v, %v", released, err)
	}
	if got := a.LookupByID(102); got == nil || !got.Labels.Equal(dns) {
		t.Errorf("LookupByID(102) = %v", got)
	}
	if got := a.LookupByLabels(dns); got == nil || got.ID != 102 {
		t.Errorf("LookupByLabels(kube-dns) = %v", got)
	}
	var listed []identity.NumericIdentity
	for _, e := range a.List() {
		if e.Identity.ID >= 100 && e.Identity.ID <= 115 && e.Source == SourceReserved {
			listed = append(listed, e.Identity.ID)
		}
	}
	if len(listed) != 16 {
		t.Errorf("listed well-known identities %v, want 100..115", listed)
	}

	cfg.EnableWellKnownIdentities = false
	off, _, _ := testAllocatorWith(t, cfg, identity.MaxLocalIdentity)
	if _, _, err := off.Allocate(context.Background(), dns); !errors.Is(err, ErrNoGlobalBackend) {
		t.Errorf("kube-dns without well-known identities: %v, want a global allocation", err)
	}
	if got := off.LookupByID(102); got != nil {
		t.Errorf("LookupByID(102) without well-known identities = %v", got)
	}
}

func TestConfigPolicyCIDRMatchMode(t *testing.T) {
	cfg := DefaultConfig
	for _, mode := range [][]string{{"pods"}, {"nodes", "x"}, {""}} {
		cfg.PolicyCIDRMatchMode = mode
		if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "policy-cidr-match-mode") {
			t.Errorf("mode %q: %v, want an error", mode, err)
		}
	}
	for _, mode := range [][]string{nil, {"nodes"}} {
		cfg.PolicyCIDRMatchMode = mode
		if err := cfg.Validate(); err != nil {
			t.Errorf("mode %q: %v", mode, err)
		}
	}
	if !nodesConfig().ReservedConfig().PolicyCIDRMatchesNodes || DefaultConfig.ReservedConfig().PolicyCIDRMatchesNodes {
		t.Error("ReservedConfig")
	}
	if DefaultConfig.EnableWellKnownIdentities || DefaultConfig.K8sNamespace != "kube-system" {
		t.Error("defaults: well-known identities must be off and the namespace kube-system")
	}
}

func TestGlobalWithoutBackend(t *testing.T) {
	a, _, _ := testAllocator(t, identity.MaxLocalIdentity)
	_, _, err := a.Allocate(context.Background(), labels.MustParse("k8s:app=web"))
	if !errors.Is(err, ErrNoGlobalBackend) {
		t.Fatalf("global allocation without backend: %v, want ErrNoGlobalBackend", err)
	}
}

func TestInvalidLabels(t *testing.T) {
	a, _, _ := testAllocator(t, identity.MaxLocalIdentity)
	bad := labels.Labels{{Source: "cidr", Key: "a;b"}}
	_, _, err := a.Allocate(context.Background(), bad)
	if !errors.Is(err, ErrInvalidLabels) || !errors.Is(err, labels.ErrSemicolon) {
		t.Fatalf("allocate invalid labels: %v", err)
	}
}

func TestRequestedIDAndWithhold(t *testing.T) {
	a, _, _ := testAllocator(t, identity.MaxLocalIdentity)
	const (
		first  = identity.NumericIdentity(16777217)
		second = identity.NumericIdentity(16777218)
		wanted = identity.NumericIdentity(16777300)
	)
	a.Withhold([]identity.NumericIdentity{first, wanted})
	if got := a.Withheld(); !slices.Equal(got, []identity.NumericIdentity{first, wanted}) {
		t.Fatalf("Withheld = %v", got)
	}
	// Withheld IDs are skipped by ordinary allocations...
	id, _ := mustAlloc(t, a, cidr("10.0.0.0/8"))
	if id.ID != second {
		t.Fatalf("allocation with %d withheld = %d, want %d", first, id.ID, second)
	}
	// ...but handed out when requested.
	id, _ = mustAlloc(t, a, cidr("10.1.0.0/16"), WithOldID(wanted))
	if id.ID != wanted {
		t.Fatalf("requested withheld ID: got %d, want %d", id.ID, wanted)
	}
	// A requested ID in use, or of another scope, is not honoured.
	id, _ = mustAlloc(t, a, cidr("10.2.0.0/16"), WithOldID(wanted))
	if id.ID == wanted {
		t.Fatal("requested ID in use was handed out twice")
	}
	rn, _ := mustAlloc(t, a, remoteNode("192.168.0.1"), WithOldID(16777400))
	if rn.ID.Scope() != identity.ScopeRemoteNode {
		t.Fatalf("requested ID of another scope honoured: %d", rn.ID)
	}
	a.Unwithhold([]identity.NumericIdentity{first, wanted})
	if len(a.Withheld()) != 0 {
		t.Fatal("unwithhold left IDs")
	}
	// The counter wraps around to the now free first ID eventually; a
	// requested free ID is honoured directly.
	id, _ = mustAlloc(t, a, cidr("10.3.0.0/16"), WithOldID(first))
	if id.ID != first {
		t.Fatalf("requested free ID: got %d, want %d", id.ID, first)
	}
}

// TestNewNumbersAboveRequested: after numbers are asked back (as
// restoration asks back every number it restores), new numbers go above
// the highest of them, not into the gaps below: should this run's
// checkpoint be lost, its journal names numbers above every restored one.
func TestNewNumbersAboveRequested(t *testing.T) {
	a, _, _ := testAllocator(t, identity.MaxLocalIdentity)
	const restored = identity.NumericIdentity(16777300)
	mustAlloc(t, a, cidr("10.9.0.0/16"), WithOldID(restored))
	mustAlloc(t, a, cidr("10.8.0.0/16"), WithOldID(restored-50))
	for i := range 3 {
		id, _ := mustAlloc(t, a, cidr(fmt.Sprintf("10.0.%d.0/24", i)))
		if want := restored + 1 + identity.NumericIdentity(i); id.ID != want {
			t.Fatalf("new identity %d = %d, want %d (above the requested %d)", i, id.ID, want, restored)
		}
	}
}

func TestExhaustion(t *testing.T) {
	a, _, _ := testAllocator(t, 4)
	ids := map[identity.NumericIdentity]bool{}
	a.Withhold([]identity.NumericIdentity{16777220})
	for i := range 3 {
		id, _ := mustAlloc(t, a, cidr(fmt.Sprintf("10.0.%d.0/24", i)))
		ids[id.ID] = true
	}
	if ids[16777220] {
		t.Fatal("withheld ID handed out while others were free")
	}
	// Only the withheld ID is left: it is claimed rather than failing.
	id, _ := mustAlloc(t, a, cidr("10.0.9.0/24"))
	if id.ID != 16777220 {
		t.Fatalf("exhausted scope claimed %d, want the withheld 16777220", id.ID)
	}
	_, _, err := a.Allocate(context.Background(), cidr("10.0.10.0/24"))
	if !errors.Is(err, ErrLocalSpaceExhausted) {
		t.Fatalf("allocation in a full scope: %v, want ErrLocalSpaceExhausted", err)
	}
	// Releasing one makes room again, and the wrap-around finds it.
	if _, err := a.Release(context.Background(), a.LookupByID(16777218)); err != nil {
		t.Fatal(err)
	}
	id, _ = mustAlloc(t, a, cidr("10.0.10.0/24"))
	if id.ID != 16777218 {
		t.Fatalf("after release got %d, want 16777218", id.ID)
	}
	// The other scope is independent.
	if _, _, err := a.Allocate(context.Background(), remoteNode("192.168.0.1")); err != nil {
		t.Fatalf("remote-node scope affected by local exhaustion: %v", err)
	}
}

type recordingHandler struct {
	mu    sync.Mutex
	calls []struct{ added, deleted IdentityMap }
}

func (h *recordingHandler) UpdateIdentities(added, deleted IdentityMap) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.calls = append(h.calls, struct{ added, deleted IdentityMap }{added, deleted})
}

func (h *recordingHandler) snapshot() []struct{ added, deleted IdentityMap } {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.calls)
}

func TestHandlerBatches(t *testing.T) {
	h := &recordingHandler{}
	a, _, _ := testAllocator(t, identity.MaxLocalIdentity, h)
	// The reserved identities arrive first, in one call.
	eventually.True(t, "reserved batch", func() bool { return len(h.snapshot()) == 1 })
	if got := len(h.snapshot()[0].added); got != 10 {
		t.Fatalf("first batch has %d identities, want the 10 reserved", got)
	}

	reqs := make([]Request, 100)
	for i := range reqs {
		reqs[i] = Request{Labels: cidr(fmt.Sprintf("10.%d.0.0/16", i))}
	}
	for _, r := range a.AllocateBatch(context.Background(), reqs) {
		if r.Err != nil || !r.Allocated {
			t.Fatalf("batch result %+v", r)
		}
	}
	eventually.True(t, "batch", func() bool { return len(h.snapshot()) == 2 })
	if got := h.snapshot()[1]; len(got.added) != 100 || len(got.deleted) != 0 {
		t.Fatalf("batch call: %d added, %d deleted; want 100 added in one call", len(got.added), len(got.deleted))
	}

	// An add and a delete of the same ID within one batch cancel out;
	// the other changes of the batch still arrive together.
	a.queue.hold()
	tmp, _ := mustAlloc(t, a, cidr("172.16.0.0/12"))
	kept, _ := mustAlloc(t, a, cidr("172.17.0.0/16"))
	gone := a.LookupByLabels(cidr("10.0.0.0/16"))
	if _, err := a.Release(context.Background(), tmp); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Release(context.Background(), gone); err != nil {
		t.Fatal(err)
	}
	a.queue.release()
	eventually.True(t, "third batch", func() bool { return len(h.snapshot()) == 3 })
	got := h.snapshot()[2]
	if _, ok := got.added[tmp.ID]; ok {
		t.Fatal("add+delete in one batch was delivered as an add")
	}
	if _, ok := got.deleted[tmp.ID]; ok {
		t.Fatal("add+delete in one batch was delivered as a delete")
	}
	if _, ok := got.added[kept.ID]; !ok || len(got.added) != 1 {
		t.Fatalf("batch added %v, want only %d", got.added, kept.ID)
	}
	if _, ok := got.deleted[gone.ID]; !ok || len(got.deleted) != 1 {
		t.Fatalf("batch deleted %v, want only %d", got.deleted, gone.ID)
	}
	time.Sleep(20 * time.Millisecond)
	if n := len(h.snapshot()); n != 3 {
		t.Fatalf("%d handler calls, want 3 (one per batch)", n)
	}
}

func TestObserveReplaySyncLive(t *testing.T) {
	a, _, _ := testAllocator(t, identity.MaxLocalIdentity)
	pre, _ := mustAlloc(t, a, cidr("10.0.0.0/8"))
	eventually.True(t, "dispatch", func() bool { return len(a.disp.snapshot()) == 11 })

	ctx, cancel := context.WithCancel(context.Background())
	var mu sync.Mutex
	var got []Change
	done := make(chan error, 1)
	a.Observe(ctx, func(c Change) {
		mu.Lock()
		got = append(got, c)
		mu.Unlock()
	}, func(err error) { done <- err })

	eventually.True(t, "replay", func() bool { mu.Lock(); defer mu.Unlock(); return len(got) >= 12 })
	live, _ := mustAlloc(t, a, cidr("10.1.0.0/16"))
	if _, err := a.Release(context.Background(), live); err != nil {
		t.Fatal(err)
	}
	eventually.True(t, "live", func() bool { mu.Lock(); defer mu.Unlock(); return len(got) >= 14 })
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("complete(%v), want context.Canceled", err)
	}

	mu.Lock()
	defer mu.Unlock()
	for i := range 10 {
		if got[i].Kind != ChangeUpsert || got[i].ID != identity.NumericIdentity(i+1) {
			t.Fatalf("replay[%d] = %+v, want reserved %d", i, got[i], i+1)
		}
	}
	if got[10].Kind != ChangeUpsert || got[10].ID != pre.ID {
		t.Fatalf("replay[10] = %+v, want %d", got[10], pre.ID)
	}
	if got[11].Kind != ChangeSync {
		t.Fatalf("after replay: %+v, want sync", got[11])
	}
	if got[12].Kind != ChangeUpsert || got[12].ID != live.ID || got[13].Kind != ChangeDelete || got[13].ID != live.ID {
		t.Fatalf("live events %+v %+v", got[12], got[13])
	}
	if len(got) != 14 {
		t.Fatalf("%d events, want 14", len(got))
	}
}

func TestTableInStep(t *testing.T) {
	a, db, table := testAllocator(t, identity.MaxLocalIdentity)
	id, _ := mustAlloc(t, a, cidr("10.0.0.0/8"))
	mustAlloc(t, a, cidr("10.0.0.0/8"))
	restored, _ := mustAlloc(t, a, cidr("10.9.0.0/16"), AsRestored())
	row := func(nid identity.NumericIdentity) (Entry, bool) {
		e, _, ok := table.Get(db.ReadTxn(), EntryIDIndex.Query(nid))
		return e, ok
	}
	eventually.True(t, "row with 2 refs", func() bool { e, ok := row(id.ID); return ok && e.RefCount == 2 })
	eventually.True(t, "restored row", func() bool { e, ok := row(restored.ID); return ok && e.Source == SourceRestored })
	if e, _, ok := table.Get(db.ReadTxn(), EntryLabelsIndex.Query(cidr("10.0.0.0/8").Canonical())); !ok || e.Identity.ID != id.ID {
		t.Fatal("labels index does not find the identity")
	}
	if e, ok := row(identity.ReservedIdentityWorld); !ok || e.Source != SourceReserved {
		t.Fatal("reserved identity missing from table")
	}
	// A non-restored reference ends the restored state.
	mustAlloc(t, a, cidr("10.9.0.0/16"))
	eventually.True(t, "restored row becomes local", func() bool { e, ok := row(restored.ID); return ok && e.Source == SourceLocal && e.RefCount == 2 })

	a.Release(context.Background(), id)
	eventually.True(t, "row with 1 ref", func() bool { e, ok := row(id.ID); return ok && e.RefCount == 1 })
	a.Release(context.Background(), id)
	eventually.True(t, "row gone", func() bool { _, ok := row(id.ID); return !ok })
}

// bareTableWriter returns a table writer on a new identities table,
// without its goroutine: the test decides when it writes.
func bareTableWriter(t *testing.T) (*statedb.DB, statedb.RWTable[Entry], *tableWriter) {
	t.Helper()
	db := statedb.New()
	table, err := NewTable(db)
	if err != nil {
		t.Fatal(err)
	}
	return db, table, newTableWriter(db, table)
}

// TestTableWriterChunks checks that the table writer writes a burst in
// transactions of at most tableWriterChunk rows, and that flush writes
// both the rest of a backlog and what was queued after it was taken.
func TestTableWriterChunks(t *testing.T) {
	db, table, w := bareTableWriter(t)
	sets := cidrSets(2*tableWriterChunk + 500)
	entry := func(i int) *refEntry {
		e := &refEntry{ident: identity.Identity{ID: identity.NumericIdentity(identity.ScopeLocal) | identity.NumericIdentity(i+1), Labels: sets[i]}}
		e.refs.Store(1)
		return e
	}
	burst := make([]*refEntry, 2*tableWriterChunk)
	for i := range burst {
		burst[i] = entry(i)
	}
	w.touchAll(burst)
	rows := func() int { return table.NumObjects(db.ReadTxn()) }

	if !w.WriteChunk(tableWriterChunk, true) {
		t.Fatal("first chunk of a burst of two reported nothing left")
	}
	if got := rows(); got != tableWriterChunk {
		t.Fatalf("%d rows after one chunk, want %d", got, tableWriterChunk)
	}
	// Changes queued while a backlog is written wait for the next one.
	late := make([]*refEntry, 0, 500)
	for i := len(burst); i < len(sets); i++ {
		late = append(late, entry(i))
	}
	w.touchAll(late)
	// A written entry that changes is queued again; one in the backlog
	// is written once, with its count at that time.
	burst[0].refs.Store(3)
	w.touchAll([]*refEntry{burst[0], burst[len(burst)-1]})
	burst[len(burst)-1].refs.Store(5)

	w.Flush()
	if got := rows(); got != len(sets) {
		t.Fatalf("%d rows after flush, want %d", got, len(sets))
	}
	for _, c := range []struct {
		e    *refEntry
		refs int
	}{{burst[0], 3}, {burst[len(burst)-1], 5}, {late[0], 1}} {
		row, _, ok := table.Get(db.ReadTxn(), EntryIDIndex.Query(c.e.ident.ID))
		if !ok || row.RefCount != c.refs {
			t.Fatalf("row of %d: %+v (found %v), want %d refs", c.e.ident.ID, row, ok, c.refs)
		}
		if c.e.flags.Load()&entryDirty != 0 {
			t.Fatalf("entry %d still marked dirty after it was written", c.e.ident.ID)
		}
	}
	if w.WriteChunk(tableWriterChunk, true) || w.Queued() {
		t.Fatal("rows left after flush")
	}
}

// TestTableFlushEnds: changes queued while a flush writes wait for the
// next one, so that a flush at stop ends however busy the allocator is.
// Here every row written queues another change, through the writer's
// known callback.
func TestTableFlushEnds(t *testing.T) {
	_, _, w := bareTableWriter(t)
	const first, bound = 100, 100_000
	next := 0
	// released is a global entry this node let go of, which makes the
	// writer ask known whether the identity still exists.
	released := func() *refEntry {
		next++
		e := &refEntry{ident: identity.Identity{ID: identity.NumericIdentity(1000 + next), Labels: cidr("10.0.0.0/8")}}
		e.flags.Store(entryGlobal)
		return e
	}
	w.known = func(identity.NumericIdentity) bool {
		if next < bound {
			w.touch(released())
		}
		return false
	}
	for range first {
		w.touch(released())
	}
	w.Flush()
	if next != 2*first {
		t.Fatalf("the flush wrote until %d changes were made, want it to stop after the %d queued when it started", next, first)
	}
	if !w.Queued() {
		t.Fatal("the changes made during the flush were lost")
	}
}

// TestHitAllocatesNothing: another reference on a held local identity,
// and dropping it again, allocate no memory (the allocation options of a
// call without options used to escape to the heap).
func TestHitAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates on its own")
	}
	a, _, _ := testAllocator(t, identity.MaxLocalIdentity)
	ctx := context.Background()
	set := cidr("10.1.0.0/16")
	held, _ := mustAlloc(t, a, set)
	allocs := testing.AllocsPerRun(1000, func() {
		id, allocated, err := a.Allocate(ctx, set)
		if err != nil || allocated || id != held {
			t.Fatalf("hit: %v, %v, %v", id, allocated, err)
		}
		if last, err := a.Release(ctx, id); err != nil || last {
			t.Fatalf("release of a second reference: %v, %v", last, err)
		}
	})
	// The table writer's lists grow now and then; a fraction of an
	// allocation per call is theirs.
	if allocs >= 0.5 {
		t.Fatalf("a hit and its release allocate %.2f times, want none", allocs)
	}
}

// TestConcurrentAllocateRelease: goroutines allocate and release
// overlapping label sets; afterwards refcounts are exact, a label set kept
// its ID while held, and no ID denoted two label sets.
func TestConcurrentAllocateRelease(t *testing.T) {
	a, _, _ := testAllocator(t, identity.MaxLocalIdentity)
	const (
		workers = 8
		sets    = 64
	)
	duration := 2 * time.Second
	if testing.Short() {
		duration = 300 * time.Millisecond
	}
	lbls := make([]labels.Labels, sets)
	for i := range lbls {
		if i%4 == 0 {
			lbls[i] = remoteNode(fmt.Sprintf("192.168.0.%d", i))
		} else {
			lbls[i] = cidr(fmt.Sprintf("10.%d.0.0/16", i))
		}
	}
	var (
		mu      sync.Mutex
		idOwner = map[identity.NumericIdentity]string{} // ID -> label key while held
		errs    []error
	)
	held := make([][]int, workers) // per worker: refs it holds per set
	deadline := time.Now().Add(duration)
	var wg sync.WaitGroup
	for w := range workers {
		held[w] = make([]int, sets)
		wg.Add(1)
		go func() {
			defer wg.Done()
			ids := make([]*identity.Identity, sets)
			for i := 0; time.Now().Before(deadline); i++ {
				s := (i*7 + w*13) % sets
				if held[w][s] > 0 && i%3 == 0 {
					if _, err := a.Release(context.Background(), ids[s]); err != nil {
						mu.Lock()
						errs = append(errs, err)
						mu.Unlock()
						return
					}
					held[w][s]--
					continue
				}
				id, _, err := a.Allocate(context.Background(), lbls[s])
				if err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
					return
				}
				if held[w][s] > 0 && id.ID != ids[s].ID {
					mu.Lock()
					errs = append(errs, fmt.Errorf("set %d changed ID from %d to %d while held", s, ids[s].ID, id.ID))
					mu.Unlock()
				}
				if !id.Labels.Equal(lbls[s]) {
					mu.Lock()
					errs = append(errs, fmt.Errorf("ID %d returned for %s carries %s", id.ID, lbls[s], id.Labels))
					mu.Unlock()
				}
				mu.Lock()
				if owner, ok := idOwner[id.ID]; ok && owner != lbls[s].Canonical() && a.LookupByID(id.ID) != nil && a.LookupByID(id.ID).Labels.Canonical() != owner {
					errs = append(errs, fmt.Errorf("ID %d denoted %s and %s", id.ID, owner, lbls[s].Canonical()))
				}
				idOwner[id.ID] = lbls[s].Canonical()
				mu.Unlock()
				ids[s] = id
				held[w][s]++
			}
		}()
	}
	wg.Wait()
	for _, err := range errs {
		t.Error(err)
	}
	// Exact refcounts: the sum of what the workers hold.
	byID := map[identity.NumericIdentity]labels.Labels{}
	for s := range sets {
		want := 0
		for w := range workers {
			want += held[w][s]
		}
		id := a.LookupByLabels(lbls[s])
		if want == 0 {
			if id != nil {
				t.Errorf("set %d held by nobody still has identity %d", s, id.ID)
			}
			continue
		}
		if id == nil {
			t.Errorf("set %d held %d times has no identity", s, want)
			continue
		}
		if other, dup := byID[id.ID]; dup {
			t.Errorf("ID %d shared by %s and %s", id.ID, other, lbls[s])
		}
		byID[id.ID] = lbls[s]
		var e *refEntry
		if s := a.scopeOf(id.ID.Scope()); s != nil {
			e = s.lookupByID(id.ID)
		}
		if got := int(e.refs.Load()); got != want {
			t.Errorf("set %d: refcount %d, want %d", s, got, want)
		}
	}
}
