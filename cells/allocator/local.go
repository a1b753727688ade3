package allocator

import (
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// keyBufSize is the stack buffer for building canonical strings on the hot
// path; larger sets fall back to a heap buffer.
const keyBufSize = 256

// refEntry is an identity held on this node with its reference count. The
// identity is embedded so that one allocation holds both.
type refEntry struct {
	ident identity.Identity
	// refs is changed with atomics while the scope's read lock is held,
	// and only taken to or from zero under its write lock, so that hits
	// and non-final releases never block each other.
	refs atomic.Int32
	// restored is set while every reference was taken by restoration.
	restored atomic.Bool
	// dirty is set when refs changed since the identities table last saw
	// the entry, so that a hot identity is queued for the table once.
	dirty atomic.Bool
}

// localScope allocates the numeric identities of one node-local scope.
type localScope struct {
	scope    identity.Scope
	log      *slog.Logger
	min, max identity.NumericIdentity // counter bounds, without the scope bits
	events   *eventQueue

	mu    sync.RWMutex
	byKey map[string]*refEntry
	byID  map[identity.NumericIdentity]*refEntry
	// next is the counter value tried first by the next allocation.
	next     identity.NumericIdentity
	withheld map[identity.NumericIdentity]struct{}
}

func newLocalScope(scope identity.Scope, log *slog.Logger, events *eventQueue, maxCounter identity.NumericIdentity) *localScope {
	return &localScope{
		scope:    scope,
		log:      log,
		min:      identity.MinLocalIdentity,
		max:      maxCounter,
		events:   events,
		byKey:    map[string]*refEntry{},
		byID:     map[identity.NumericIdentity]*refEntry{},
		next:     identity.MinLocalIdentity,
		withheld: map[identity.NumericIdentity]struct{}{},
	}
}

// acquire returns the identity of lbls with one more reference, allocating
// it if needed.
func (s *localScope) acquire(lbls labels.Labels, o *allocateOptions) (*identity.Identity, bool, error) {
	var buf [keyBufSize]byte
	key := lbls.AppendCanonical(buf[:0])

	// Fast path: a label set held already takes a reference under the
	// read lock. An entry in the maps always has refs >= 1 because the
	// last reference is only dropped under the write lock.
	s.mu.RLock()
	if e := s.byKey[string(key)]; e != nil {
		e.refs.Add(1)
		s.touch(e, o)
		s.mu.RUnlock()
		return &e.ident, false, nil
	}
	s.mu.RUnlock()

	s.mu.Lock()
	defer s.mu.Unlock()
	if e := s.byKey[string(key)]; e != nil {
		e.refs.Add(1)
		s.touch(e, o)
		return &e.ident, false, nil
	}
	id, err := s.pickID(o.oldID)
	if err != nil {
		return nil, false, err
	}
	e := &refEntry{ident: identity.Identity{ID: id, Labels: lbls}}
	e.refs.Store(1)
	e.restored.Store(o.restored)
	s.byKey[string(key)] = e
	s.byID[id] = e
	s.events.push(Change{Kind: ChangeUpsert, ID: id, Labels: lbls})
	return &e.ident, true, nil
}

// touch records a reference taken on an existing entry: a non-restored
// reference ends the restored state, and the table learns the new count.
func (s *localScope) touch(e *refEntry, o *allocateOptions) {
	if !o.restored && e.restored.Load() {
		e.restored.Store(false)
	}
	s.events.touch(e)
}

// pickID chooses the numeric ID for a new identity. The caller holds the
// write lock.
func (s *localScope) pickID(old identity.NumericIdentity) (identity.NumericIdentity, error) {
	// A requested ID is honoured when it belongs to this scope and is
	// free, withheld or not: withholding exists to keep it for this call.
	if old != identity.InvalidIdentity && old.Scope() == s.scope {
		counter := old &^ identity.ScopeMask
		if counter >= s.min && counter <= s.max && s.byID[old] == nil {
			return old, nil
		}
	}
	size := uint64(s.max-s.min) + 1
	if uint64(len(s.byID)) < size {
		c := s.next
		for range size {
			if c > s.max || c < s.min {
				c = s.min
			}
			id := identity.NumericIdentity(s.scope) | c
			c++
			if s.byID[id] != nil {
				continue
			}
			if _, held := s.withheld[id]; held {
				continue
			}
			s.next = c
			return id, nil
		}
		// Every free ID is withheld: claiming one beats failing, but
		// the restart that withheld it may now lose its number.
		for id := range s.withheld {
			if s.byID[id] == nil {
				s.log.Warn("Local identity space exhausted, handing out a withheld identity",
					"scope", s.scope, "identity", id)
				return id, nil
			}
		}
	}
	return identity.InvalidIdentity, fmt.Errorf("%w: all %d IDs of scope %s are in use", ErrLocalSpaceExhausted, size, s.scope)
}

// release drops one reference on id.
func (s *localScope) release(id identity.NumericIdentity) (bool, error) {
	s.mu.RLock()
	e := s.byID[id]
	if e != nil {
		// Not the last reference: drop it under the read lock.
		for {
			r := e.refs.Load()
			if r <= 1 {
				break
			}
			if e.refs.CompareAndSwap(r, r-1) {
				s.events.touch(e)
				s.mu.RUnlock()
				return false, nil
			}
		}
	}
	s.mu.RUnlock()
	if e == nil {
		return false, fmt.Errorf("%w: %d", ErrUnknownIdentity, id)
	}

	s.mu.Lock()
	defer s.mu.Unlock()
	if s.byID[id] != e {
		return false, fmt.Errorf("%w: %d", ErrUnknownIdentity, id)
	}
	if e.refs.Add(-1) > 0 {
		s.events.touch(e)
		return false, nil
	}
	delete(s.byID, id)
	var buf [keyBufSize]byte
	delete(s.byKey, string(e.ident.Labels.AppendCanonical(buf[:0])))
	s.events.push(Change{Kind: ChangeDelete, ID: id, Labels: e.ident.Labels})
	return true, nil
}

func (s *localScope) lookupByKey(key []byte) *refEntry {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.byKey[string(key)]
}

func (s *localScope) lookupByID(id identity.NumericIdentity) *refEntry {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.byID[id]
}

func (s *localScope) withhold(ids []identity.NumericIdentity) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, id := range ids {
		if id.Scope() == s.scope {
			s.withheld[id] = struct{}{}
		}
	}
}

func (s *localScope) unwithhold(ids []identity.NumericIdentity) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, id := range ids {
		delete(s.withheld, id)
	}
}

func (s *localScope) withheldIDs() []identity.NumericIdentity {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := make([]identity.NumericIdentity, 0, len(s.withheld))
	for id := range s.withheld {
		out = append(out, id)
	}
	return out
}

// entries calls fn for every entry under the read lock.
func (s *localScope) entries(fn func(*refEntry)) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	for _, e := range s.byID {
		fn(e)
	}
}

func (s *localScope) len() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return len(s.byID)
}
