package globalstore

import (
	"sync"
	"sync/atomic"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// Sink is where a store reports and what it reads of this node: the Events
// that receive the changes of its cache, and the References it writes
// again after a loss. A store takes its Sink from the hive's Sinks when it
// is built and uses it from its start hook on; the allocator (or the
// double-write cell, for the stores it composes) binds the Sink when it is
// built, so before any store starts. An unbound Sink drops the changes and
// holds no references: a hive without an allocator runs a store alone.
type Sink struct {
	to atomic.Pointer[sinkTarget]
}

type sinkTarget struct {
	events Events
	refs   References
}

var (
	_ Events     = (*Sink)(nil)
	_ References = (*Sink)(nil)
)

// Bind sends the Sink's changes to events and reads references from refs.
// A later Bind replaces the earlier one.
func (s *Sink) Bind(events Events, refs References) {
	s.to.Store(&sinkTarget{events: events, refs: refs})
}

// Upsert implements Events.
func (s *Sink) Upsert(id identity.NumericIdentity, lbls labels.Labels) {
	if t := s.to.Load(); t != nil && t.events != nil {
		t.events.Upsert(id, lbls)
	}
}

// Delete implements Events.
func (s *Sink) Delete(id identity.NumericIdentity, lbls labels.Labels) {
	if t := s.to.Load(); t != nil && t.events != nil {
		t.events.Delete(id, lbls)
	}
}

// Synced implements Events.
func (s *Sink) Synced() {
	if t := s.to.Load(); t != nil && t.events != nil {
		t.events.Synced()
	}
}

// Each implements References.
func (s *Sink) Each(fn func(*Reference)) {
	if t := s.to.Load(); t != nil && t.refs != nil {
		t.refs.Each(fn)
	}
}

// ByID implements References.
func (s *Sink) ByID(id identity.NumericIdentity) *Reference {
	if t := s.to.Load(); t != nil && t.refs != nil {
		return t.refs.ByID(id)
	}
	return nil
}

// Sinks holds one Sink per allocation mode: a store of global identities
// reports to the Sink of its pure mode (identity.AllocationModeKVStore or
// identity.AllocationModeCRD), and the allocator binds the Sink of the
// configured mode. In a pure mode both are the same Sink; in a
// double-write mode the double-write cell binds the pure modes' Sinks to
// its comparison of the stores, which reports to the configured mode's.
// The allocator cell provides it; a store in a hive without one reports
// to an unbound Sink.
type Sinks struct {
	mu     sync.Mutex
	modes  map[identity.AllocationMode]*Sink
	remote Sink
}

// Remote returns the Sink a Remote reports other clusters' identities to.
// A nil *Sinks returns a new unbound Sink.
func (s *Sinks) Remote() *Sink {
	if s == nil {
		return new(Sink)
	}
	return &s.remote
}

// NewSinks returns Sinks with nothing bound.
func NewSinks() *Sinks {
	return &Sinks{modes: map[identity.AllocationMode]*Sink{}}
}

// For returns the Sink of mode (the empty mode is kvstore, the default).
// A nil *Sinks returns a new unbound Sink.
func (s *Sinks) For(mode identity.AllocationMode) *Sink {
	if s == nil {
		return new(Sink)
	}
	if mode == "" {
		mode = identity.AllocationModeKVStore
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	sink, ok := s.modes[mode]
	if !ok {
		sink = new(Sink)
		s.modes[mode] = sink
	}
	return sink
}
