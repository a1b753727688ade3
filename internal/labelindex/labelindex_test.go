package labelindex

import (
	"math/rand/v2"
	"strconv"
	"testing"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// owner is what the allocator's local scope keeps beside its index: each
// ID's label set, to confirm the candidates.
type owner struct {
	x      Index
	labels map[identity.NumericIdentity]labels.Labels
}

// find returns the ID of lbls, whose hash is h, as the local scope finds
// it, or 0.
func (o *owner) find(h uint64, lbls labels.Labels) identity.NumericIdentity {
	for id := range o.x.Candidates(h) {
		if o.labels[id].Equal(lbls) {
			return id
		}
	}
	return 0
}

// labelSets returns n distinct label sets; the index sees only their
// hashes, which the test chooses.
func labelSets(n int) []labels.Labels {
	out := make([]labels.Labels, n)
	for i := range out {
		out[i] = labels.MustParse("k8s:app=a" + strconv.Itoa(i))
	}
	return out
}

// TestIndexAgainstMap drives the index with random inserts and removes
// under few distinct hashes, so that probe runs collide, wrap around the
// end of a shard and get shifted back on removal, and checks every lookup
// against a plain map.
func TestIndexAgainstMap(t *testing.T) {
	for _, hashes := range []uint64{1, 7, 64, 1 << 20} {
		r := rand.New(rand.NewPCG(hashes, 1))
		o := &owner{labels: map[identity.NumericIdentity]labels.Labels{}}
		x := &o.x
		want := map[identity.NumericIdentity]uint64{}
		// Under one or a few hashes every lookup walks a run of about
		// half the sets: fewer sets keep the runs, and the test's time.
		sets := labelSets(4096)
		if hashes < 64 {
			sets = sets[:512]
		}
		// A hash's top bits choose the shard: fold the few hashes into
		// two shards, and spread the low bits so that runs wrap.
		hashOf := func(i int) uint64 {
			v := uint64(i) % hashes
			return (v%2)<<63 | v*0x9E3779B97F4A7C15>>1&^(1<<63)
		}
		idOf := func(i int) identity.NumericIdentity {
			return identity.NumericIdentity(identity.ScopeLocal) | identity.NumericIdentity(i+1)
		}
		for step := range 20_000 {
			i := r.IntN(len(sets))
			id := idOf(i)
			h := hashOf(i)
			if _, held := want[id]; held && r.IntN(2) == 0 {
				if !x.Remove(h, id) {
					t.Fatalf("step %d: remove of %d found nothing", step, id)
				}
				delete(o.labels, id)
				delete(want, id)
			} else if !held {
				o.labels[id] = sets[i]
				x.Insert(h, id)
				want[id] = h
			}
			// Check a few sets, held or not.
			for range 2 {
				j := r.IntN(len(sets))
				jid := idOf(j)
				wantID := jid
				if _, held := want[jid]; !held {
					wantID = 0
				}
				if got := o.find(hashOf(j), sets[j]); got != wantID {
					t.Fatalf("step %d (hashes %d): find(%v) = %v, want %v", step, hashes, sets[j], got, wantID)
				}
			}
		}
		if got := x.len(); got != len(want) {
			t.Fatalf("len = %d, want %d", got, len(want))
		}
		for id, h := range want {
			if got := o.find(h, o.labels[id]); got != id {
				t.Fatalf("find(%d) = %v after the run", id, got)
			}
		}
		// Emptying the index gives its memory back.
		for id, h := range want {
			x.Remove(h, id)
			delete(o.labels, id)
		}
		for i := range x.shards {
			if s := x.shards[i]; s.n != 0 || len(s.slots) > shardMinSlots {
				t.Fatalf("shard %d keeps %d entries in %d slots after removing everything", i, s.n, len(s.slots))
			}
		}
	}
}

func TestIndexRemoveUnknown(t *testing.T) {
	o := &owner{labels: map[identity.NumericIdentity]labels.Labels{}}
	x := &o.x
	id := identity.NumericIdentity(identity.ScopeLocal) | 1
	lbls := labels.MustParse("cidr:10.0.0.1/32")
	if x.Remove(42, id) {
		t.Fatal("remove from an empty index reported success")
	}
	o.labels[id] = lbls
	x.Insert(42, id)
	if x.Remove(42, id+1) {
		t.Fatal("remove of an entry never inserted reported success")
	}
	if o.find(42, lbls) != id {
		t.Fatal("the inserted entry is lost")
	}
}

// len returns the number of entries, counted over the shards.
func (x *Index) len() int {
	n := 0
	for i := range x.shards {
		n += x.shards[i].n
	}
	return n
}
