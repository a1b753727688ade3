// Package labelindex finds the numeric IDs of label sets by the hash of
// their labels, for the allocator's local scopes: it stores no labels and
// no pointers, so its owner confirms each candidate against its own
// record.
package labelindex

import (
	"iter"

	"github.com/identityd/identityd/identity"
)

// Index finds IDs by the hash of their label set.
//
// It is an open-addressing hash table with linear probing, split into
// shards by the hash's top bits. A slot holds 32 bits of the hash and the
// numeric ID, whose entry its owner holds: eight bytes without pointers,
// so the garbage collector never scans the index, and a lookup that finds
// nothing (every new identity) costs one cache miss, against two for a Go
// map. A shard grows on its own, so growing never rehashes more than 1/256
// of the identities under the owner's write lock. Equal tags are told
// apart by the owner, which compares the labels of each candidate.
//
// The zero Index is empty and ready to use. It is not safe for concurrent
// use: its owner locks it.
type Index struct {
	shards [1 << shardBits]shard
}

const (
	shardBits = 8
	// shardMinSlots is the size of a shard's first table.
	shardMinSlots = 16
)

type shard struct {
	// slots has a power-of-two length, or is nil while the shard is
	// empty.
	slots []slot
	n     int
}

// slot is one slot; an empty slot has ID 0, which no local identity has
// and the index never stores.
type slot struct {
	tag uint32
	id  identity.NumericIdentity
}

func (x *Index) shard(h uint64) *shard {
	return &x.shards[h>>(64-shardBits)]
}

// tagOf is the part of a hash kept in a slot; a slot's position derives
// from it too, so that growing needs no rehashing of labels.
func tagOf(h uint64) uint32 { return uint32(h) }

// Candidates yields the IDs stored under a hash with the same tag as h,
// in the order of its probe sequence. Its owner compares each candidate's
// labels with the ones it looks for, and stops at the first match; an
// insert or remove ends the sequence's validity. It is small enough to be
// inlined, loop body and all, into its owner's lookup.
func (x *Index) Candidates(h uint64) iter.Seq[identity.NumericIdentity] {
	return func(yield func(identity.NumericIdentity) bool) {
		s := x.shard(h)
		if s.n == 0 {
			return
		}
		tag := tagOf(h)
		mask := uint32(len(s.slots) - 1)
		for i := tag & mask; ; i = (i + 1) & mask {
			sl := s.slots[i]
			if sl.id == 0 {
				return
			}
			if sl.tag == tag && !yield(sl.id) {
				return
			}
		}
	}
}

// Insert adds id under h; id must not be in the index yet, and must not
// be 0, which marks an empty slot.
func (x *Index) Insert(h uint64, id identity.NumericIdentity) {
	s := x.shard(h)
	// Keep the load at most 3/4, so that probe sequences stay short.
	if (s.n+1)*4 > len(s.slots)*3 {
		s.resize(max(shardMinSlots, 2*len(s.slots)))
	}
	s.put(slot{tag: tagOf(h), id: id})
	s.n++
}

// put stores a slot in the first free place of its probe sequence.
func (s *shard) put(sl slot) {
	mask := uint32(len(s.slots) - 1)
	i := sl.tag & mask
	for s.slots[i].id != 0 {
		i = (i + 1) & mask
	}
	s.slots[i] = sl
}

func (s *shard) resize(size int) {
	old := s.slots
	s.slots = make([]slot, size)
	for _, sl := range old {
		if sl.id != 0 {
			s.put(sl)
		}
	}
}

// Remove deletes id, stored under h. It reports whether id was found.
func (x *Index) Remove(h uint64, id identity.NumericIdentity) bool {
	s := x.shard(h)
	if s.n == 0 || id == 0 {
		return false
	}
	mask := uint32(len(s.slots) - 1)
	i := tagOf(h) & mask
	for s.slots[i].id != id {
		if s.slots[i].id == 0 {
			return false
		}
		i = (i + 1) & mask
	}
	// Backward-shift deletion: move later members of the probe run
	// into the hole when their home slot does not lie between the hole
	// and where they are, so that no lookup stops early at the hole and
	// no tombstones accumulate.
	for j := (i + 1) & mask; s.slots[j].id != 0; j = (j + 1) & mask {
		home := s.slots[j].tag & mask
		if (j-home)&mask >= (j-i)&mask {
			s.slots[i] = s.slots[j]
			i = j
		}
	}
	s.slots[i] = slot{}
	s.n--
	// Give memory back after mass releases, with hysteresis against
	// flapping around one size.
	if len(s.slots) > shardMinSlots && s.n*8 < len(s.slots) {
		if s.n == 0 {
			s.slots = nil
		} else {
			s.resize(len(s.slots) / 2)
		}
	}
	return true
}
