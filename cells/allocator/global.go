package allocator

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// globalRefs counts this node's references on global identities. Like a
// local scope, hits and non-final releases only take the read lock. The
// first reference and the last release of a label set call the backend; a
// call in flight for a label set makes others for the same set wait, so
// that an allocation never races with the deletion of the same reference.
type globalRefs struct {
	backend globalstore.Backend
	events  *eventQueue
	// timeout bounds each call that reaches the backend or waits for
	// another one (--identity-allocation-timeout); hits need neither.
	timeout time.Duration

	mu       sync.RWMutex
	byKey    map[string]*refEntry
	byID     map[identity.NumericIdentity]*refEntry
	inflight map[string]chan struct{}
}

func newGlobalRefs(backend globalstore.Backend, events *eventQueue, timeout time.Duration) *globalRefs {
	return &globalRefs{
		backend:  backend,
		events:   events,
		timeout:  timeout,
		byKey:    map[string]*refEntry{},
		byID:     map[identity.NumericIdentity]*refEntry{},
		inflight: map[string]chan struct{}{},
	}
}

func (g *globalRefs) acquire(ctx context.Context, lbls labels.Labels, o *allocateOptions) (*identity.Identity, bool, error) {
	var buf [keyBufSize]byte
	key := lbls.AppendCanonical(buf[:0])

	g.mu.RLock()
	if e := g.byKey[string(key)]; e != nil {
		e.refs.Add(1)
		g.events.touch(e)
		g.mu.RUnlock()
		return &e.ident, false, nil
	}
	g.mu.RUnlock()

	if g.backend == nil {
		return nil, false, ErrNoGlobalBackend
	}
	if err := lbls.Validate(); err != nil {
		return nil, false, fmt.Errorf("%w: %w", ErrInvalidLabels, err)
	}
	skey := string(key)
	ctx, cancel := context.WithTimeout(ctx, g.timeout)
	defer cancel()
	for {
		g.mu.Lock()
		if e := g.byKey[skey]; e != nil {
			e.refs.Add(1)
			g.events.touch(e)
			g.mu.Unlock()
			return &e.ident, false, nil
		}
		wait, busy := g.inflight[skey]
		if !busy {
			done := make(chan struct{})
			g.inflight[skey] = done
			g.mu.Unlock()
			return g.create(ctx, skey, lbls, done)
		}
		g.mu.Unlock()
		select {
		case <-wait:
		case <-ctx.Done():
			return nil, false, fmt.Errorf("waiting for another allocation of %s: %w", lbls, ctx.Err())
		}
	}
}

func (g *globalRefs) create(ctx context.Context, key string, lbls labels.Labels, done chan struct{}) (*identity.Identity, bool, error) {
	id, allocated, err := g.backend.Allocate(ctx, lbls)
	g.mu.Lock()
	defer g.mu.Unlock()
	delete(g.inflight, key)
	close(done)
	if err != nil {
		return nil, false, err
	}
	e := &refEntry{ident: identity.Identity{ID: id, Labels: lbls}}
	e.flags.Store(entryGlobal)
	e.refs.Store(1)
	g.byKey[key] = e
	g.byID[id] = e
	// The backend's cache reports the identity too; the dispatcher drops
	// the echo. Queuing it here makes it visible before this call returns.
	g.events.pushEvent(event{kind: ChangeUpsert, ident: &e.ident, ref: e})
	return &e.ident, allocated, nil
}

func (g *globalRefs) release(ctx context.Context, id identity.NumericIdentity) (bool, error) {
	g.mu.RLock()
	e := g.byID[id]
	// Not the last reference: drop it under the read lock.
	if e != nil && e.dropNonFinal() {
		g.events.touch(e)
		g.mu.RUnlock()
		return false, nil
	}
	g.mu.RUnlock()
	if e == nil {
		return false, fmt.Errorf("%w: %d", ErrUnknownIdentity, id)
	}

	g.mu.Lock()
	if g.byID[id] != e {
		g.mu.Unlock()
		return false, fmt.Errorf("%w: %d", ErrUnknownIdentity, id)
	}
	if e.refs.Add(-1) > 0 {
		g.events.touch(e)
		g.mu.Unlock()
		return false, nil
	}
	key := e.ident.Labels.Canonical()
	delete(g.byID, id)
	delete(g.byKey, key)
	done := make(chan struct{})
	g.inflight[key] = done
	// The identity stays in the store; the table row only learns that
	// this node's count is zero.
	g.events.touch(e)
	g.mu.Unlock()

	ctx, cancel := context.WithTimeout(ctx, g.timeout)
	err := g.backend.Release(ctx, id, e.ident.Labels)
	cancel()
	g.mu.Lock()
	delete(g.inflight, key)
	close(done)
	g.mu.Unlock()
	if err != nil {
		return true, fmt.Errorf("releasing global identity %d: %w (its reference key expires with the node's lease)", id, err)
	}
	return true, nil
}

func (g *globalRefs) lookupByKey(key []byte) *refEntry {
	g.mu.RLock()
	defer g.mu.RUnlock()
	return g.byKey[string(key)]
}

func (g *globalRefs) lookupByID(id identity.NumericIdentity) *refEntry {
	g.mu.RLock()
	defer g.mu.RUnlock()
	return g.byID[id]
}

// entry returns the table entry of a held id, read under the lock as
// entries reads it.
func (g *globalRefs) entry(id identity.NumericIdentity) (Entry, bool) {
	g.mu.RLock()
	defer g.mu.RUnlock()
	if e := g.byID[id]; e != nil {
		return entryOf(e), true
	}
	return Entry{}, false
}

func (g *globalRefs) entries(fn func(*refEntry)) {
	g.mu.RLock()
	defer g.mu.RUnlock()
	for _, e := range g.byID {
		fn(e)
	}
}
