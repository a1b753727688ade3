package allocator

import (
	"context"
	"errors"
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
//
// It is also the only record of which label sets this node references in
// the global store: the backend reads it (globalstore.References) when it
// writes them again, and adds to it from inside Allocate (record), under
// its own write lock, so that no reference it wrote is missing from the
// record when a lost lease's repair enumerates it. The lock order is the
// backend's locks, then mu: nothing here calls the backend holding mu.
type globalRefs struct {
	backend globalstore.Backend
	events  *eventQueue
	// timeout bounds each call that reaches the backend or waits for
	// another one (--identity-allocation-timeout); hits need neither.
	timeout time.Duration

	mu       sync.RWMutex
	byKey    map[string]*globalEntry
	byID     map[identity.NumericIdentity]*globalEntry
	inflight map[string]chan struct{}
	// space counts the store's refusals for want of an ID; nil without
	// one.
	space *spaceWatch
}

// globalEntry is a refEntry with the backend's reference. The reference
// lives beside the entry rather than in it: refEntry, shared with the local
// scopes, must stay within its size class.
type globalEntry struct {
	refEntry
	ref *globalstore.Reference
}

var _ globalstore.References = (*globalRefs)(nil)

func newGlobalRefs(backend globalstore.Backend, events *eventQueue, timeout time.Duration) *globalRefs {
	return &globalRefs{
		backend:  backend,
		events:   events,
		timeout:  timeout,
		byKey:    map[string]*globalEntry{},
		byID:     map[identity.NumericIdentity]*globalEntry{},
		inflight: map[string]chan struct{}{},
	}
}

func (g *globalRefs) acquire(ctx context.Context, lbls labels.Labels, o *allocateOptions) (*identity.Identity, bool, error) {
	var buf [keyBufSize]byte
	key := lbls.AppendCanonical(buf[:0])

	g.mu.RLock()
	if e := g.byKey[string(key)]; e != nil {
		e.refs.Add(1)
		g.events.touch(&e.refEntry)
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
			g.events.touch(&e.refEntry)
			g.mu.Unlock()
			return &e.ident, false, nil
		}
		wait, busy := g.inflight[skey]
		if !busy {
			done := make(chan struct{})
			g.inflight[skey] = done
			g.mu.Unlock()
			return g.create(ctx, skey, lbls, done, o.adoptOnly)
		}
		g.mu.Unlock()
		select {
		case <-wait:
		case <-ctx.Done():
			return nil, false, fmt.Errorf("waiting for another allocation of %s: %w", lbls, ctx.Err())
		}
	}
}

func (g *globalRefs) create(ctx context.Context, key string, lbls labels.Labels, done chan struct{}, adoptOnly bool) (*identity.Identity, bool, error) {
	var e *globalEntry
	// The backend calls record under its write lock, right after the
	// reference was written: from then on the entry is in the record a
	// repair of the backend's keys enumerates, and hits find it. The key
	// stays in flight until Allocate returned, so no second create starts
	// before, and the entry's last release cannot begin before the caller
	// has its reference.
	record := func(ref *globalstore.Reference) {
		e = &globalEntry{refEntry: refEntry{ident: identity.Identity{ID: ref.ID, Labels: lbls}}, ref: ref}
		e.flags.Store(entryGlobal)
		e.refs.Store(1)
		g.mu.Lock()
		g.byKey[key] = e
		g.byID[ref.ID] = e
		// The backend's cache reports the identity too; the
		// dispatcher drops the echo. Queuing it with the entry makes
		// it visible before any allocation that finds the entry
		// returns.
		g.events.pushEvent(event{kind: ChangeUpsert, ident: &e.ident, ref: &e.refEntry})
		g.mu.Unlock()
	}
	var (
		id        identity.NumericIdentity
		allocated bool
		err       error
	)
	if adoptOnly {
		id, err = g.backend.Adopt(ctx, lbls, record)
	} else {
		id, allocated, err = g.backend.Allocate(ctx, lbls, record)
	}
	if errors.Is(err, globalstore.ErrSpaceExhausted) {
		g.space.refusedAllocation()
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	// A release of more references than were taken may have begun the
	// entry's last release meanwhile and put its own mark in flight,
	// which is not this call's to clear.
	if g.inflight[key] == done {
		delete(g.inflight, key)
	}
	close(done)
	if err == nil && (e == nil || e.ident.ID != id) {
		err = fmt.Errorf("global backend returned identity %d without recording this node's reference to it", id)
	}
	if err != nil {
		if e != nil && g.byID[e.ident.ID] == e {
			// A backend breaking its contract. Nobody holds the entry:
			// take it out of the record (the reference it wrote ends
			// with the backend's lease) and tell the table its count
			// is zero.
			delete(g.byKey, key)
			delete(g.byID, e.ident.ID)
			e.refs.Store(0)
			g.events.touch(&e.refEntry)
		}
		return nil, false, err
	}
	return &e.ident, allocated, nil
}

func (g *globalRefs) release(ctx context.Context, id identity.NumericIdentity) (bool, error) {
	g.mu.RLock()
	e := g.byID[id]
	// Not the last reference: drop it under the read lock.
	if e != nil && e.dropNonFinal() {
		g.events.touch(&e.refEntry)
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
		g.events.touch(&e.refEntry)
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
	g.events.touch(&e.refEntry)
	g.mu.Unlock()

	// Out of the record now, so no repair that reads it from here on
	// writes the reference again; one that read it before stores its
	// write in e.ref, which the backend reads under the lock that repair
	// holds.
	ctx, cancel := context.WithTimeout(ctx, g.timeout)
	err := g.backend.Release(ctx, e.ref)
	cancel()
	g.mu.Lock()
	if g.inflight[key] == done {
		delete(g.inflight, key)
	}
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
	if e := g.byKey[string(key)]; e != nil {
		return &e.refEntry
	}
	return nil
}

func (g *globalRefs) lookupByID(id identity.NumericIdentity) *refEntry {
	g.mu.RLock()
	defer g.mu.RUnlock()
	if e := g.byID[id]; e != nil {
		return &e.refEntry
	}
	return nil
}

// entry returns the table entry of a held id, read under the lock as
// entries reads it.
func (g *globalRefs) entry(id identity.NumericIdentity) (Entry, bool) {
	g.mu.RLock()
	defer g.mu.RUnlock()
	if e := g.byID[id]; e != nil {
		return entryOf(&e.refEntry), true
	}
	return Entry{}, false
}

func (g *globalRefs) entries(fn func(*refEntry)) {
	g.mu.RLock()
	defer g.mu.RUnlock()
	for _, e := range g.byID {
		fn(&e.refEntry)
	}
}

// Each implements globalstore.References: fn runs on a copy, outside mu,
// so that a backend writing to its store for each reference holds up no
// allocation.
func (g *globalRefs) Each(fn func(*globalstore.Reference)) {
	g.mu.RLock()
	refs := make([]*globalstore.Reference, 0, len(g.byID))
	for _, e := range g.byID {
		refs = append(refs, e.ref)
	}
	g.mu.RUnlock()
	for _, r := range refs {
		fn(r)
	}
}

// ByID implements globalstore.References.
func (g *globalRefs) ByID(id identity.NumericIdentity) *globalstore.Reference {
	g.mu.RLock()
	defer g.mu.RUnlock()
	if e := g.byID[id]; e != nil {
		return e.ref
	}
	return nil
}
