// Package idpool keeps the free numeric IDs of a range for the global
// allocator. An ID is available, leased (picked by a caller who is trying to
// claim it) or gone (used here or known to be used elsewhere).
//
// Leases pick a random available ID, so that nodes allocating at the same
// time rarely try the same one and etcd transactions rarely conflict.
package idpool

import (
	"math/rand/v2"
	"sync"
)

// ID is a numeric ID of the pool's range.
type ID uint32

// NoID is returned when the pool has no available ID.
const NoID ID = 0

// Pool is safe for concurrent use.
type Pool struct {
	mu       sync.Mutex
	min, max ID
	// available holds the free IDs in arbitrary order; pos maps an ID to
	// its index there, so that a random pick and a removal are O(1).
	available []ID
	pos       map[ID]int
	leased    map[ID]struct{}
}

// New returns a pool in which every ID of [min, max] is available. min must
// be above NoID.
func New(min, max ID) *Pool {
	if min == NoID {
		min = 1
	}
	p := &Pool{min: min, max: max, leased: map[ID]struct{}{}}
	if max >= min {
		n := int(max - min + 1)
		p.available = make([]ID, 0, n)
		p.pos = make(map[ID]int, n)
		for id := min; ; id++ {
			p.pos[id] = len(p.available)
			p.available = append(p.available, id)
			if id == max {
				break
			}
		}
	} else {
		p.pos = map[ID]int{}
	}
	return p
}

// InRange reports whether id belongs to the pool's range.
func (p *Pool) InRange(id ID) bool { return id >= p.min && id <= p.max }

func (p *Pool) take(id ID) bool {
	i, ok := p.pos[id]
	if !ok {
		return false
	}
	last := len(p.available) - 1
	moved := p.available[last]
	p.available[i] = moved
	p.pos[moved] = i
	p.available = p.available[:last]
	delete(p.pos, id)
	return true
}

func (p *Pool) put(id ID) {
	p.pos[id] = len(p.available)
	p.available = append(p.available, id)
}

// LeaseAvailableID leases a random available ID, or returns NoID when none
// is available. The caller must Use or Release it.
func (p *Pool) LeaseAvailableID() ID {
	p.mu.Lock()
	defer p.mu.Unlock()
	id := p.takeRandom()
	if id != NoID {
		p.leased[id] = struct{}{}
	}
	return id
}

// AllocateID takes a random available ID for good (lease and use at once).
func (p *Pool) AllocateID() ID {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.takeRandom()
}

// takeRandom takes a random available ID out of the available ones, or
// returns NoID when there is none.
func (p *Pool) takeRandom() ID {
	if len(p.available) == 0 {
		return NoID
	}
	id := p.available[rand.IntN(len(p.available))]
	p.take(id)
	return id
}

// Release returns a leased ID to the available ones. It reports whether id
// was leased.
func (p *Pool) Release(id ID) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.endLease(id) {
		return false
	}
	p.put(id)
	return true
}

// Use marks a leased ID as gone. It reports whether id was leased; a lease
// that was meanwhile removed (someone else took the ID) is not usable.
func (p *Pool) Use(id ID) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.endLease(id)
}

// endLease removes id's lease and reports whether it had one.
func (p *Pool) endLease(id ID) bool {
	if _, ok := p.leased[id]; !ok {
		return false
	}
	delete(p.leased, id)
	return true
}

// Insert makes a gone ID available again (its master key was deleted). It
// reports whether anything changed; IDs out of range are ignored.
func (p *Pool) Insert(id ID) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.InRange(id) {
		return false
	}
	if _, ok := p.pos[id]; ok {
		return false
	}
	if _, ok := p.leased[id]; ok {
		return false
	}
	p.put(id)
	return true
}

// Remove marks an ID as gone because it is used elsewhere. An ID that is
// leased stays leased but can no longer be used (Use reports false), so a
// caller racing with a remote allocation does not claim it.
func (p *Pool) Remove(id ID) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.leased[id]; ok {
		delete(p.leased, id)
		return true
	}
	return p.take(id)
}

// Available returns the number of available IDs.
func (p *Pool) Available() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.available)
}

// Size returns the number of IDs in the range.
func (p *Pool) Size() int {
	if p.max < p.min {
		return 0
	}
	return int(p.max-p.min) + 1
}
