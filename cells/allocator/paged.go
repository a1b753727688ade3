package allocator

import (
	"maps"
	"slices"

	"github.com/identityd/identityd/identity"
)

// pagedTable maps the 24-bit counter of a local identity to a value in a
// three-level radix tree of 256-way nodes: local IDs are dense and mostly
// sequential, so leaves cost 8 bytes per identity and no hashing, against
// ~30 for a map, and a lookup takes three array loads, the first two of
// which stay in the cache.
//
// A leaf or middle node is freed when its last value is removed, so that
// memory follows the identities held, not the highest counter ever used:
// local IDs are handed out in order with wrap-around, and an agent that
// churns identities walks its whole counter space. The last freed node of
// each level is kept for the next one needed, so that an allocation and a
// release that cross into an empty leaf and out again allocate nothing.
// Scans and the search for a free ID skip absent and full nodes, so their
// cost follows the identities held too.
type pagedTable[T any] struct {
	mids [pagedFanout]*pagedMid[T]
	n    int
	// spareMid and spareLeaf are emptied nodes kept for reuse; a node is
	// all nil when it is emptied, so reuse needs no clearing.
	spareMid  *pagedMid[T]
	spareLeaf *pagedLeaf[T]
}

const (
	pagedBits   = 8
	pagedFanout = 1 << pagedBits
	pagedMask   = pagedFanout - 1
	// pagedMidValues is how many counters a middle node covers.
	pagedMidValues = pagedFanout * pagedFanout
)

// pagedLeaf is 2 KiB, a size class of its own.
type pagedLeaf[T any] [pagedFanout]*T

type pagedMid[T any] struct {
	leaves [pagedFanout]*pagedLeaf[T]
	// counts is the number of values in each leaf.
	counts [pagedFanout]uint16
	// n is the number of values under this node.
	n int
}

func pagedSplit(id identity.NumericIdentity) (hi, mid, lo uint32) {
	c := uint32(id &^ identity.ScopeMask)
	return c >> (2 * pagedBits), (c >> pagedBits) & pagedMask, c & pagedMask
}

func (t *pagedTable[T]) get(id identity.NumericIdentity) *T {
	hi, mi, lo := pagedSplit(id)
	m := t.mids[hi]
	if m == nil {
		return nil
	}
	l := m.leaves[mi]
	if l == nil {
		return nil
	}
	return l[lo]
}

// set stores v under id; nil removes it.
func (t *pagedTable[T]) set(id identity.NumericIdentity, v *T) {
	hi, mi, lo := pagedSplit(id)
	m := t.mids[hi]
	if m == nil {
		if v == nil {
			return
		}
		m = t.newMid()
		t.mids[hi] = m
	}
	l := m.leaves[mi]
	if l == nil {
		if v == nil {
			return
		}
		l = t.newLeaf()
		m.leaves[mi] = l
	}
	old := l[lo]
	l[lo] = v
	switch {
	case old == nil && v != nil:
		t.n++
		m.n++
		m.counts[mi]++
	case old != nil && v == nil:
		t.n--
		m.n--
		if m.counts[mi]--; m.counts[mi] == 0 {
			m.leaves[mi] = nil
			t.spareLeaf = l
			if m.n == 0 {
				t.mids[hi] = nil
				t.spareMid = m
			}
		}
	}
}

func (t *pagedTable[T]) newMid() *pagedMid[T] {
	if m := t.spareMid; m != nil {
		t.spareMid = nil
		return m
	}
	return new(pagedMid[T])
}

func (t *pagedTable[T]) newLeaf() *pagedLeaf[T] {
	if l := t.spareLeaf; l != nil {
		t.spareLeaf = nil
		return l
	}
	return new(pagedLeaf[T])
}

// firstFree returns the lowest counter in [from, to] without a value.
func (t *pagedTable[T]) firstFree(from, to identity.NumericIdentity) (identity.NumericIdentity, bool) {
	for c := from; c <= to; {
		hi, mi, lo := pagedSplit(c)
		m := t.mids[hi]
		if m == nil {
			return c, true
		}
		if m.n == pagedMidValues {
			c = (c | (pagedMidValues - 1)) + 1
			continue
		}
		l := m.leaves[mi]
		if l == nil {
			return c, true
		}
		if m.counts[mi] == pagedFanout {
			c = (c | pagedMask) + 1
			continue
		}
		for ; lo < pagedFanout && c <= to; lo, c = lo+1, c+1 {
			if l[lo] == nil {
				return c, true
			}
		}
	}
	return 0, false
}

// each calls fn for every value in the order of the counters.
func (t *pagedTable[T]) each(fn func(*T)) {
	for _, m := range t.mids {
		if m == nil {
			continue
		}
		for _, l := range m.leaves {
			if l == nil {
				continue
			}
			for _, v := range l {
				if v != nil {
					fn(v)
				}
			}
		}
	}
}

// identityState is the set of identities the dispatcher has delivered. The
// local scopes, where a burst may add a million identities, live in paged
// tables; the rest (reserved, global, remote clusters) in a map.
type identityState struct {
	local, remote pagedTable[identity.Identity]
	other         map[identity.NumericIdentity]*identity.Identity
}

func newIdentityState() identityState {
	return identityState{other: map[identity.NumericIdentity]*identity.Identity{}}
}

func (s *identityState) pages(id identity.NumericIdentity) *pagedTable[identity.Identity] {
	switch id.Scope() {
	case identity.ScopeLocal:
		return &s.local
	case identity.ScopeRemoteNode:
		return &s.remote
	}
	return nil
}

func (s *identityState) get(id identity.NumericIdentity) (*identity.Identity, bool) {
	if p := s.pages(id); p != nil {
		v := p.get(id)
		return v, v != nil
	}
	v, ok := s.other[id]
	return v, ok
}

func (s *identityState) set(ident *identity.Identity) {
	if p := s.pages(ident.ID); p != nil {
		p.set(ident.ID, ident)
		return
	}
	s.other[ident.ID] = ident
}

func (s *identityState) delete(id identity.NumericIdentity) {
	if p := s.pages(id); p != nil {
		p.set(id, nil)
		return
	}
	delete(s.other, id)
}

func (s *identityState) len() int { return s.local.n + s.remote.n + len(s.other) }

// each calls fn for every identity in the order of the numeric IDs.
func (s *identityState) each(fn func(*identity.Identity)) {
	// The other scopes' IDs are all below the local scopes'.
	for _, id := range slices.Sorted(maps.Keys(s.other)) {
		fn(s.other[id])
	}
	s.local.each(fn)
	s.remote.each(fn)
}
