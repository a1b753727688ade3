package allocator

import (
	"math/rand/v2"
	"testing"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// TestLabelIndexAgainstMap drives the index with random inserts and removes
// under few distinct hashes, so that probe runs collide, wrap around the
// end of a shard and get shifted back on removal, and checks every lookup
// against a plain map.
func TestLabelIndexAgainstMap(t *testing.T) {
	for _, hashes := range []uint64{1, 7, 64, 1 << 20} {
		r := rand.New(rand.NewPCG(hashes, 1))
		var byID idTable
		x := labelIndex{byID: &byID}
		want := map[identity.NumericIdentity]*refEntry{}
		sets := cidrSets(4096)
		// A hash's top bits choose the shard: fold the few hashes into
		// two shards, and spread the low bits so that runs wrap.
		hashOf := func(i int) uint64 {
			v := uint64(i) % hashes
			return (v%2)<<63 | v*0x9E3779B97F4A7C15>>1&^(1<<63)
		}
		for step := range 20_000 {
			i := r.IntN(len(sets))
			id := identity.NumericIdentity(identity.ScopeLocal) | identity.NumericIdentity(i+1)
			h := hashOf(i)
			if e, held := want[id]; held && r.IntN(2) == 0 {
				if !x.remove(h, e) {
					t.Fatalf("step %d: remove of %d found nothing", step, id)
				}
				byID.Set(id, nil)
				delete(want, id)
			} else if !held {
				e := &refEntry{ident: identity.Identity{ID: id, Labels: sets[i]}, hash: h}
				byID.Set(id, e)
				x.insert(h, e)
				want[id] = e
			}
			// Check a few sets, held or not.
			for range 2 {
				j := r.IntN(len(sets))
				jid := identity.NumericIdentity(identity.ScopeLocal) | identity.NumericIdentity(j+1)
				if got := x.find(hashOf(j), sets[j]); got != want[jid] {
					t.Fatalf("step %d (hashes %d): find(%v) = %v, want %v", step, hashes, sets[j], got, want[jid])
				}
			}
		}
		if got := x.len(); got != len(want) {
			t.Fatalf("len = %d, want %d", got, len(want))
		}
		for id, e := range want {
			if got := x.find(e.hash, e.ident.Labels); got != e {
				t.Fatalf("find(%d) = %v after the run", id, got)
			}
		}
		// Emptying the index gives its memory back.
		for id, e := range want {
			x.remove(e.hash, e)
			byID.Set(id, nil)
		}
		for i := range x.shards {
			if s := x.shards[i]; s.n != 0 || len(s.slots) > labelShardMinSlots {
				t.Fatalf("shard %d keeps %d entries in %d slots after removing everything", i, s.n, len(s.slots))
			}
		}
	}
}

func TestLabelIndexRemoveUnknown(t *testing.T) {
	var byID idTable
	x := labelIndex{byID: &byID}
	e := &refEntry{ident: identity.Identity{ID: identity.NumericIdentity(identity.ScopeLocal) | 1, Labels: labels.MustParse("cidr:10.0.0.1/32")}, hash: 42}
	if x.remove(42, e) {
		t.Fatal("remove from an empty index reported success")
	}
	byID.Set(e.ident.ID, e)
	x.insert(42, e)
	other := &refEntry{ident: identity.Identity{ID: e.ident.ID + 1}, hash: 42}
	if x.remove(42, other) {
		t.Fatal("remove of an entry never inserted reported success")
	}
	if x.find(42, e.ident.Labels) != e {
		t.Fatal("the inserted entry is lost")
	}
}

// len returns the number of entries, counted over the shards.
func (x *labelIndex) len() int {
	n := 0
	for i := range x.shards {
		n += x.shards[i].n
	}
	return n
}
