package allocator

import (
	"context"
	"fmt"
	"log/slog"
	"runtime"
	"testing"

	"github.com/cilium/statedb"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// churnLocal makes n allocate/release cycles of label sets no one else
// holds, as a node whose FQDN or CIDR identities come and go does: each
// cycle takes the next counter value.
func churnLocal(tb testing.TB, a *identityAllocator, sets []labels.Labels, n int) {
	tb.Helper()
	ctx := context.Background()
	for i := range n {
		id, allocated, err := a.Allocate(ctx, sets[i%len(sets)])
		if err != nil || !allocated {
			tb.Fatalf("cycle %d: allocate: allocated %v, %v", i, allocated, err)
		}
		if released, err := a.Release(ctx, id); err != nil || !released {
			tb.Fatalf("cycle %d: release %d: released %v, %v", i, id.ID, released, err)
		}
	}
}

// churnSets returns label sets for churnLocal, apart from cidrSets' ones.
func churnSets(n int) []labels.Labels {
	out := make([]labels.Labels, n)
	for i := range out {
		out[i] = cidr(fmt.Sprintf("172.16.%d.%d/32", i>>8&0xFF, i&0xFF))
	}
	return out
}

// settle lets the dispatcher and the table writer catch up, so that what
// they keep is what the allocator holds.
func settle(a *identityAllocator) {
	for a.disp.drain() > 0 {
	}
	a.table.Flush()
}

// TestLocalWrapsAfterChurn runs a scope of 2^17 IDs through four full
// wraps (one with the race detector) while a few identities stay held: every new identity gets the next
// free counter value, around the held ones, and the scope's table ends up
// as small as that of a scope holding only those.
func TestLocalWrapsAfterChurn(t *testing.T) {
	const space = 1 << 17
	a, _, _ := testAllocator(t, space)
	held := cidrSets(3)
	var heldIDs []identity.NumericIdentity
	for _, s := range held {
		id, _ := mustAlloc(t, a, s)
		heldIDs = append(heldIDs, id.ID)
	}
	ctx := t.Context()
	sets := churnSets(64)
	wraps := 4
	if raceEnabled || testing.Short() {
		wraps = 1
	}
	want := identity.NumericIdentity(identity.ScopeLocal) | 4
	for i := range wraps*space + 100 {
		id, allocated, err := a.Allocate(ctx, sets[i%len(sets)])
		if err != nil || !allocated {
			t.Fatalf("cycle %d: allocated %v, %v", i, allocated, err)
		}
		if id.ID != want {
			t.Fatalf("cycle %d: got %d, want %d", i, id.ID, want)
		}
		if _, err := a.Release(ctx, id); err != nil {
			t.Fatal(err)
		}
		if want++; want&^identity.ScopeMask > space {
			want = identity.NumericIdentity(identity.ScopeLocal) | 4 // past the held 1..3
		}
	}
	if mids, leaves := a.local.byID.Nodes(); mids != 1 || leaves != 1 {
		t.Fatalf("after churn the ID table has %d middle nodes and %d leaves for %d held identities, want 1 and 1", mids, leaves, len(heldIDs))
	}
	settle(a)
	if mids, leaves := a.disp.state.Nodes(); mids != 1 || leaves != 1 {
		t.Fatalf("after churn the dispatcher's table has %d middle nodes and %d leaves, want 1 and 1", mids, leaves)
	}
}

// TestLocalMemoryAfterChurn checks that an allocator's heap follows the
// identities it holds, not its history: after allocate/release cycles that
// walk the counter far ahead, it uses no more than 10% more heap than a
// fresh allocator holding the same identities.
func TestLocalMemoryAfterChurn(t *testing.T) {
	cycles := 1 << 20
	if raceEnabled || testing.Short() {
		cycles = 1 << 18
	}
	held := cidrSets(4096)
	sets := churnSets(256)
	ctx := t.Context()
	measure := func(churn int) uint64 {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		db := statedb.New()
		table, err := NewTable(db)
		if err != nil {
			t.Fatal(err)
		}
		a := newIdentityAllocator(DefaultConfig, slog.New(slog.DiscardHandler), db, table, nil, nil, identity.MaxLocalIdentity)
		if err := a.startStandalone(ctx); err != nil {
			t.Fatal(err)
		}
		for _, s := range held {
			mustAlloc(t, a, s)
		}
		churnLocal(t, a, sets, churn)
		settle(a)
		// After a burst a node goes on with a trickle of changes,
		// with which the scratch lists shrink to the work of the
		// moment.
		for range 2 {
			churnLocal(t, a, sets, 1)
			settle(a)
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		runtime.KeepAlive(a)
		a.stopStandalone(ctx)
		return after.HeapAlloc - before.HeapAlloc
	}
	measure(0) // what the first allocator of a process sets up once
	fresh := measure(0)
	churned := measure(cycles)
	t.Logf("heap of an allocator holding %d identities: fresh %d B, after %d cycles %d B (%.2fx)", len(held), fresh, cycles, churned, float64(churned)/float64(fresh))
	if float64(churned) > 1.1*float64(fresh) {
		t.Fatalf("after %d allocate/release cycles the allocator uses %d B of heap, a fresh one holding the same %d identities %d B: more than 10%% more", cycles, churned, len(held), fresh)
	}
}

// TestTableWriterPassesOverReleased checks that entries released before
// the table writer saw them cost it no rows: a chunk passes over many of
// them and still writes a held entry behind them, while an entry whose
// row was written has its row deleted on release.
func TestTableWriterPassesOverReleased(t *testing.T) {
	db, table, w := bareTableWriter(t)
	sets := cidrSets(4*tableWriterChunk + 2)
	entry := func(i, refs int) *refEntry {
		e := &refEntry{ident: identity.Identity{ID: identity.NumericIdentity(identity.ScopeLocal) | identity.NumericIdentity(i+1), Labels: sets[i]}}
		e.refs.Store(int32(refs))
		return e
	}
	written := entry(len(sets)-1, 1)
	w.touchAll([]*refEntry{written})
	w.Flush()
	rows := func() int { return table.NumObjects(db.ReadTxn()) }
	if rows() != 1 {
		t.Fatalf("%d rows, want 1", rows())
	}

	var batch []*refEntry
	for i := range 4 * tableWriterChunk {
		batch = append(batch, entry(i, 0))
	}
	held := entry(4*tableWriterChunk, 1)
	written.refs.Store(0)
	batch = append(batch, written, held)
	w.touchAll(batch)
	if w.WriteChunk(tableWriterChunk, true) {
		t.Fatalf("one chunk left rows behind %d released entries", 4*tableWriterChunk)
	}
	row, _, ok := table.Get(db.ReadTxn(), EntryIDIndex.Query(held.ident.ID))
	if !ok || row.ref != held {
		t.Fatalf("held entry's row: %+v, found %v", row, ok)
	}
	if _, _, ok := table.Get(db.ReadTxn(), EntryIDIndex.Query(written.ident.ID)); ok {
		t.Fatal("the row of a released entry is still there")
	}
	if rows() != 1 {
		t.Fatalf("%d rows, want 1", rows())
	}
	for _, e := range batch {
		if e.flags.Load()&entryDirty != 0 {
			t.Fatalf("entry %d still marked dirty", e.ident.ID)
		}
	}
}
