// Package idtable is the table of the allocator's local scopes: a map from
// the 24-bit counter of a node-local or remote-node identity to a value,
// whose memory follows the values it holds. Map, the dispatcher's record of
// delivered identities, adds the identities of the other scopes.
package idtable

import (
	"github.com/identityd/identityd/identity"
)

// Table maps the 24-bit counter of a local identity to a value in a
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
type Table[T any] struct {
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

func (t *Table[T]) Get(id identity.NumericIdentity) *T {
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

// Set stores v under id; nil removes it.
func (t *Table[T]) Set(id identity.NumericIdentity, v *T) {
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

func (t *Table[T]) newMid() *pagedMid[T] {
	if m := t.spareMid; m != nil {
		t.spareMid = nil
		return m
	}
	return new(pagedMid[T])
}

func (t *Table[T]) newLeaf() *pagedLeaf[T] {
	if l := t.spareLeaf; l != nil {
		t.spareLeaf = nil
		return l
	}
	return new(pagedLeaf[T])
}

// FirstFree returns the lowest counter in [from, to] without a value.
func (t *Table[T]) FirstFree(from, to identity.NumericIdentity) (identity.NumericIdentity, bool) {
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

// Each calls fn for every value in the order of the counters.
func (t *Table[T]) Each(fn func(*T)) {
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

// Len returns the number of values.
func (t *Table[T]) Len() int { return t.n }

// Nodes returns the number of middle nodes and leaves the table holds: its
// memory, for tests that check it follows the values held.
func (t *Table[T]) Nodes() (mids, leaves int) {
	for _, m := range t.mids {
		if m == nil {
			continue
		}
		mids++
		for _, l := range m.leaves {
			if l != nil {
				leaves++
			}
		}
	}
	return mids, leaves
}
