package crdstore

import (
	"context"
	"sync"
	"time"

	"github.com/identityd/identityd/identity"
)

// pendingSlots are the slots this node's walks are creating an object at,
// or deleting an identity to create at (reclaim), with the outcome for a
// while after it, until the cache shows it. Without them the node's own
// walks race each other: near a full range the walks of many label sets
// reach the same free slot at the end of the same run of held slots, and a
// slot a reclaim has deleted and not yet filled looks free; each walk that
// lost a create counted a conflict, allocations failed with ErrConflict,
// and a walk that reached a slot looking free announced its steps over
// the marked identities before it for nothing.
type pendingSlots struct {
	mu sync.Mutex
	m  map[identity.NumericIdentity]*pendingSlot
}

// pendingSlot is one walk's create at a slot.
type pendingSlot struct {
	id identity.NumericIdentity
	// key is the label set the walk creates.
	key  string
	done chan struct{}
	// held and until are set when done closes: whether the slot is held
	// after the create (it succeeded, or found an object there), which
	// this node's walks assume until until, by when the cache shows it.
	held  bool
	until time.Time
}

// pendingHold is how long a create's outcome stands for this node's walks
// after it: longer than the watch takes to deliver the object on a busy
// API server, and short, as a cache that still does not show it sends a
// walk to the server, as before.
const pendingHold = 2 * time.Second

// claim returns the pending create at id: a new one, which the caller
// must finish (mine), or another walk's, which the caller waits for: one
// in flight, or one that left the slot held, while that stands.
func (ps *pendingSlots) claim(id identity.NumericIdentity, key string, now time.Time) (_ *pendingSlot, mine bool) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if p := ps.m[id]; p != nil {
		select {
		case <-p.done:
			if p.held && now.Before(p.until) {
				return p, false
			}
		default:
			return p, false
		}
	}
	if ps.m == nil {
		ps.m = map[identity.NumericIdentity]*pendingSlot{}
	}
	p := &pendingSlot{id: id, key: key, done: make(chan struct{})}
	ps.m[id] = p
	return p, true
}

// finish records the outcome of the create of p, which the caller claimed.
func (ps *pendingSlots) finish(p *pendingSlot, held bool) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	select {
	case <-p.done:
		return
	default:
	}
	p.held, p.until = held, time.Now().Add(pendingHold)
	close(p.done)
	// Outcomes that no longer stand go with the next finish.
	for id, q := range ps.m {
		select {
		case <-q.done:
			if !time.Now().Before(q.until) {
				delete(ps.m, id)
			}
		default:
		}
	}
}

// heldByOther waits for the pending create at id, if there is one, and
// reports whether it left the slot held by another label set than key's,
// as far as its outcome still stands.
func (ps *pendingSlots) heldByOther(ctx context.Context, id identity.NumericIdentity, key string) (bool, error) {
	ps.mu.Lock()
	p := ps.m[id]
	ps.mu.Unlock()
	if p == nil {
		return false, nil
	}
	held, err := p.wait(ctx)
	return held && p.key != key, err
}

// wait waits for p's outcome: whether it left the slot held, while that
// stands.
func (p *pendingSlot) wait(ctx context.Context) (held bool, _ error) {
	select {
	case <-p.done:
	case <-ctx.Done():
		return false, ctx.Err()
	}
	return p.held && time.Now().Before(p.until), nil
}
