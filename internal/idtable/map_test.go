package idtable

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/identityd/identityd/identity"
)

// TestMapAgainstGoMap checks a Map, whose local scopes live in paged
// tables, against a Go map: the same lookups, the same length, and every
// identity in numeric order, as the allocator's Observe replays them.
func TestMapAgainstGoMap(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 7))
	var st Map[identity.Identity]
	want := map[identity.NumericIdentity]*identity.Identity{}
	randomID := func() identity.NumericIdentity {
		switch r.IntN(4) {
		case 0: // reserved and global, some with cluster bits
			return identity.NumericIdentity(1 + r.IntN(1<<23))
		case 1:
			return identity.NumericIdentity(identity.ScopeLocal) | identity.NumericIdentity(1+r.IntN(1<<24-1))
		case 2:
			return identity.NumericIdentity(identity.ScopeRemoteNode) | identity.NumericIdentity(1+r.IntN(1<<24-1))
		default: // a small range, so that IDs are set and deleted again
			return identity.NumericIdentity(identity.ScopeLocal) | identity.NumericIdentity(1+r.IntN(64))
		}
	}
	for step := range 20_000 {
		id := randomID()
		if _, ok := want[id]; ok && r.IntN(2) == 0 {
			st.Set(id, nil)
			delete(want, id)
		} else {
			ident := &identity.Identity{ID: id}
			st.Set(id, ident)
			want[id] = ident
		}
		probe := randomID()
		got := st.Get(probe)
		ok := got != nil
		if w, wok := want[probe]; ok != wok || got != w {
			t.Fatalf("step %d: get(%d) = %v %v, want %v %v", step, probe, got, ok, w, wok)
		}
	}
	if st.Len() != len(want) {
		t.Fatalf("len = %d, want %d", st.Len(), len(want))
	}
	var order []identity.NumericIdentity
	st.Each(func(id *identity.Identity) {
		if want[id.ID] != id {
			t.Fatalf("each yields %d, which is not in the state", id.ID)
		}
		order = append(order, id.ID)
	})
	if len(order) != len(want) || !slices.IsSorted(order) {
		t.Fatalf("each yields %d identities, sorted %v; want %d in numeric order", len(order), slices.IsSorted(order), len(want))
	}
}
