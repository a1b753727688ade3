package allocator

import (
	"fmt"
	"hash/maphash"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/idtable"
	"github.com/identityd/identityd/internal/labelindex"
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
	// flags holds the entry's flag bits (entryGlobal, entryRestored,
	// entryDirty, entryInTable) in one word: with separate fields the entry would not
	// fit the 48-byte size class.
	flags atomic.Uint32
	// hash is the label set's hash in a local scope's index.
	hash uint64
}

const (
	// entryGlobal marks entries of global identities; it never changes.
	entryGlobal uint32 = 1 << iota
	// entryRestored is set while every reference was taken by
	// restoration.
	entryRestored
	// entryDirty is set while the entry waits for the identities table,
	// so that a hot identity is queued for the table once.
	entryDirty
	// entryInTable is set once the table writer wrote a row from the
	// entry: a released entry without it has no row to delete, and the
	// writer passes it over without a transaction. It is only set and
	// cleared by the writer.
	entryInTable
)

func (e *refEntry) global() bool   { return e.flags.Load()&entryGlobal != 0 }
func (e *refEntry) restored() bool { return e.flags.Load()&entryRestored != 0 }

// markDirty marks e as waiting for the table; it reports whether e was
// not waiting yet.
func (e *refEntry) markDirty() bool {
	return e.flags.Load()&entryDirty == 0 && e.flags.Or(entryDirty)&entryDirty == 0
}

// dropNonFinal drops one reference unless it is the last one, which only
// the holder of the write lock may drop. It reports whether it dropped one.
func (e *refEntry) dropNonFinal() bool {
	for {
		r := e.refs.Load()
		if r <= 1 {
			return false
		}
		if e.refs.CompareAndSwap(r, r-1) {
			return true
		}
	}
}

// localScope allocates the numeric identities of one node-local scope.
//
// Label sets are found by a hash of their labels rather than by their
// canonical string, so that neither a lookup nor a stored identity needs
// the string: it saves an allocation per call and ~48 bytes per identity.
type localScope struct {
	scope    identity.Scope
	log      *slog.Logger
	seed     maphash.Seed
	min, max identity.NumericIdentity // counter bounds, without the scope bits
	events   *eventQueue

	mu      sync.RWMutex
	byLabel labelindex.Index
	byID    idTable
	// version counts changes of byLabel, so that an allocation that found
	// nothing under the read lock need not look again under the write
	// lock when nothing changed in between.
	version uint64
	// next is the counter value tried first by the next allocation.
	next     identity.NumericIdentity
	withheld map[identity.NumericIdentity]struct{}
}

func newLocalScope(scope identity.Scope, log *slog.Logger, events *eventQueue, maxCounter identity.NumericIdentity) *localScope {
	s := &localScope{
		scope:    scope,
		log:      log,
		seed:     maphash.MakeSeed(),
		min:      identity.MinLocalIdentity,
		max:      maxCounter,
		events:   events,
		next:     identity.MinLocalIdentity,
		withheld: map[identity.NumericIdentity]struct{}{},
	}
	return s
}

// hashLabels hashes a label set's canonical string, built on the stack.
// Equal hashes are confirmed with labels.Equal, so an unvalidated set that
// happens to collide with another cannot be mistaken for it.
func hashLabels(seed maphash.Seed, ls labels.Labels) uint64 {
	var buf [keyBufSize]byte
	return maphash.Bytes(seed, ls.AppendCanonical(buf[:0]))
}

// find returns the entry of lbls; the caller holds a lock. The index
// yields the IDs stored under the same 32 bits of the hash; their labels
// tell them apart.
func (s *localScope) find(h uint64, lbls labels.Labels) *refEntry {
	for id := range s.byLabel.Candidates(h) {
		if e := s.byID.Get(id); e.ident.Labels.Equal(lbls) {
			return e
		}
	}
	return nil
}

// acquire returns the identity of lbls with one more reference, allocating
// it if needed.
func (s *localScope) acquire(lbls labels.Labels, o *allocateOptions) (*identity.Identity, bool, error) {
	h := hashLabels(s.seed, lbls)

	// Fast path: a label set held already takes a reference under the
	// read lock. An entry in the maps always has refs >= 1 because the
	// last reference is only dropped under the write lock.
	s.mu.RLock()
	if e := s.find(h, lbls); e != nil {
		e.refs.Add(1)
		s.touch(e, o)
		s.mu.RUnlock()
		return &e.ident, false, nil
	}
	seen := s.version
	s.mu.RUnlock()

	// Only a new identity needs validation: a held set was validated
	// when it was first allocated.
	if err := lbls.Validate(); err != nil {
		return nil, false, fmt.Errorf("%w: %w", ErrInvalidLabels, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.version != seen {
		if e := s.find(h, lbls); e != nil {
			e.refs.Add(1)
			s.touch(e, o)
			return &e.ident, false, nil
		}
	}
	id, err := s.pickID(o.oldID)
	if err != nil {
		return nil, false, err
	}
	e := &refEntry{ident: identity.Identity{ID: id, Labels: lbls}, hash: h}
	e.refs.Store(1)
	if o.restored {
		e.flags.Store(entryRestored)
	}
	s.byID.Set(id, e)
	s.byLabel.Insert(h, id)
	s.version++
	// The dispatcher passes the entry on to the identities table.
	s.events.pushEvent(event{kind: ChangeUpsert, ident: &e.ident, ref: e})
	return &e.ident, true, nil
}

// touch records a reference taken on an existing entry: a non-restored
// reference ends the restored state, and the table learns the new count.
func (s *localScope) touch(e *refEntry, o *allocateOptions) {
	if !o.restored && e.restored() {
		e.flags.And(^entryRestored)
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
		if counter >= s.min && counter <= s.max && s.byID.Get(old) == nil {
			// New numbers go on above the ones asked back (restoration
			// asks back every number it restores): a start hands out
			// numbers above everything it restored, so the numbers
			// freed below stay free a whole run, and should this
			// start's checkpoint be lost, its journal still names the
			// highest number answered, above which restoration
			// withholds after damage.
			if counter >= s.next {
				s.next = counter + 1
			}
			return old, nil
		}
	}
	size := uint64(s.max-s.min) + 1
	if uint64(s.byID.Len()) < size {
		// From next to the top, then from the bottom: the table skips
		// what is full, so a search costs what the held identities
		// around next cost, however far the counter went before.
		start := min(max(s.next, s.min), s.max+1)
		for _, r := range [2][2]identity.NumericIdentity{{start, s.max}, {s.min, start - 1}} {
			for c := r[0]; c <= r[1]; c++ {
				free, ok := s.byID.FirstFree(c, r[1])
				if !ok {
					break
				}
				id := identity.NumericIdentity(s.scope) | free
				c = free
				if len(s.withheld) > 0 {
					if _, held := s.withheld[id]; held {
						continue
					}
				}
				s.next = free + 1
				return id, nil
			}
		}
		// Every free ID is withheld: claiming one beats failing, but
		// the restart that withheld it may now lose its number.
		for id := range s.withheld {
			if s.byID.Get(id) == nil {
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
	e := s.byID.Get(id)
	// Not the last reference: drop it under the read lock.
	if e != nil && e.dropNonFinal() {
		s.events.touch(e)
		s.mu.RUnlock()
		return false, nil
	}
	s.mu.RUnlock()
	if e == nil {
		return false, fmt.Errorf("%w: %d", ErrUnknownIdentity, id)
	}

	s.mu.Lock()
	defer s.mu.Unlock()
	if s.byID.Get(id) != e {
		return false, fmt.Errorf("%w: %d", ErrUnknownIdentity, id)
	}
	if e.refs.Add(-1) > 0 {
		s.events.touch(e)
		return false, nil
	}
	s.byLabel.Remove(e.hash, id)
	s.byID.Set(id, nil)
	s.version++
	s.events.pushEvent(event{kind: ChangeDelete, ident: &e.ident, ref: e})
	return true, nil
}

func (s *localScope) lookup(lbls labels.Labels) *refEntry {
	h := hashLabels(s.seed, lbls)
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.find(h, lbls)
}

func (s *localScope) lookupByID(id identity.NumericIdentity) *refEntry {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.byID.Get(id)
}

// entry returns the table entry of id, read under the lock as List reads
// it.
func (s *localScope) entry(id identity.NumericIdentity) (Entry, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if e := s.byID.Get(id); e != nil {
		return entryOf(e), true
	}
	return Entry{}, false
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
	s.byID.Each(fn)
}

func (s *localScope) len() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.byID.Len()
}

// idTable maps a local identity's counter to its entry.
type idTable = idtable.Table[refEntry]
