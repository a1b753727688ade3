package allocator

import (
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// labelIndex finds a local scope's entries by the hash of their label set.
//
// It is an open-addressing hash table with linear probing, split into
// shards by the hash's top bits. A slot holds 32 bits of the hash and the
// numeric ID, whose entry the scope's idTable holds: eight bytes without
// pointers, so the garbage collector never scans the index, and a lookup
// that finds nothing (every new identity) costs one cache miss, against
// two for a Go map. A shard grows on its own, so growing never rehashes
// more than 1/256 of the identities under the write lock. Equal tags are
// told apart by comparing the labels.
type labelIndex struct {
	shards [1 << labelIndexShardBits]labelShard
	// byID resolves a slot's ID to its entry.
	byID *idTable
}

const (
	labelIndexShardBits = 8
	// labelShardMinSlots is the size of a shard's first table.
	labelShardMinSlots = 16
)

type labelShard struct {
	// slots has a power-of-two length, or is nil while the shard is
	// empty.
	slots []labelSlot
	n     int
}

// labelSlot is one slot; an empty slot has ID 0, which no local identity
// has.
type labelSlot struct {
	tag uint32
	id  identity.NumericIdentity
}

func (x *labelIndex) shard(h uint64) *labelShard {
	return &x.shards[h>>(64-labelIndexShardBits)]
}

// tagOf is the part of a hash kept in a slot; a slot's position derives
// from it too, so that growing needs no rehashing of labels.
func tagOf(h uint64) uint32 { return uint32(h) }

// find returns the entry of lbls, whose hash is h.
func (x *labelIndex) find(h uint64, lbls labels.Labels) *refEntry {
	s := x.shard(h)
	if s.n == 0 {
		return nil
	}
	tag := tagOf(h)
	mask := uint32(len(s.slots) - 1)
	for i := tag & mask; ; i = (i + 1) & mask {
		slot := s.slots[i]
		if slot.id == 0 {
			return nil
		}
		if slot.tag == tag {
			if e := x.byID.Get(slot.id); e.ident.Labels.Equal(lbls) {
				return e
			}
		}
	}
}

// insert adds e under h; e's labels must not be in the index yet.
func (x *labelIndex) insert(h uint64, e *refEntry) {
	s := x.shard(h)
	// Keep the load at most 3/4, so that probe sequences stay short.
	if (s.n+1)*4 > len(s.slots)*3 {
		s.resize(max(labelShardMinSlots, 2*len(s.slots)))
	}
	s.put(labelSlot{tag: tagOf(h), id: e.ident.ID})
	s.n++
}

// put stores a slot in the first free place of its probe sequence.
func (s *labelShard) put(slot labelSlot) {
	mask := uint32(len(s.slots) - 1)
	i := slot.tag & mask
	for s.slots[i].id != 0 {
		i = (i + 1) & mask
	}
	s.slots[i] = slot
}

func (s *labelShard) resize(size int) {
	old := s.slots
	s.slots = make([]labelSlot, size)
	for _, slot := range old {
		if slot.id != 0 {
			s.put(slot)
		}
	}
}

// remove deletes e, stored under h. It reports whether e was found.
func (x *labelIndex) remove(h uint64, e *refEntry) bool {
	s := x.shard(h)
	if s.n == 0 {
		return false
	}
	mask := uint32(len(s.slots) - 1)
	i := tagOf(h) & mask
	for s.slots[i].id != e.ident.ID {
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
	s.slots[i] = labelSlot{}
	s.n--
	// Give memory back after mass releases, with hysteresis against
	// flapping around one size.
	if len(s.slots) > labelShardMinSlots && s.n*8 < len(s.slots) {
		if s.n == 0 {
			s.slots = nil
		} else {
			s.resize(len(s.slots) / 2)
		}
	}
	return true
}
