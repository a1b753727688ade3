// Package allocatortest has a global identity backend that keeps
// identities in memory, shared by several allocators in one process as if
// they were nodes sharing a store. It exists to test the allocator's
// global path apart from etcd; production code never uses it.
package allocatortest

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/cilium/hive/cell"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/idpool"
	"github.com/identityd/identityd/labels"
)

// Store is the shared state: master entries and per-node references.
type Store struct {
	mu    sync.Mutex
	pool  *idpool.Pool
	byID  map[identity.NumericIdentity]labels.Labels
	byKey map[string]identity.NumericIdentity
	refs  map[string]map[string]struct{} // label key -> nodes
	nodes []*Backend
	// Down makes every request fail, as an unreachable store would.
	Down atomic.Bool
	// Stalled makes every request wait until its context ends, as a
	// store that accepts requests and never answers would.
	Stalled atomic.Bool
}

// ErrDown is returned while the store is down.
var ErrDown = errors.New("store is down")

// NewStore returns a store allocating IDs of the cluster's range.
func NewStore(cluster identity.ClusterInfo) *Store {
	return &Store{
		pool:  idpool.New(idpool.ID(cluster.MinID()), idpool.ID(cluster.MaxID())),
		byID:  map[identity.NumericIdentity]labels.Labels{},
		byKey: map[string]identity.NumericIdentity{},
		refs:  map[string]map[string]struct{}{},
	}
}

// Backend is one node's view of the store.
type Backend struct {
	store *Store
	node  string
	// Requests counts calls that would be store round trips.
	Requests atomic.Int64

	mu     sync.Mutex
	events globalstore.Events
}

var _ globalstore.Backend = (*Backend)(nil)

// NewBackend returns the backend of one node.
func (s *Store) NewBackend(node string) *Backend {
	b := &Backend{store: s, node: node}
	s.mu.Lock()
	s.nodes = append(s.nodes, b)
	s.mu.Unlock()
	return b
}

// Refs returns the nodes holding a label set.
func (s *Store) Refs(lbls labels.Labels) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.refs[lbls.Canonical()])
}

// Len returns the number of identities in the store.
func (s *Store) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.byID)
}

func (s *Store) broadcast(fn func(globalstore.Events)) {
	for _, n := range s.nodes {
		n.mu.Lock()
		ev := n.events
		n.mu.Unlock()
		if ev != nil {
			fn(ev)
		}
	}
}

// Allocate implements globalstore.Backend; it records the reference while
// the store is locked, as a store's write and its record are one step.
func (b *Backend) Allocate(ctx context.Context, lbls labels.Labels, record func(*globalstore.Reference)) (identity.NumericIdentity, bool, error) {
	return b.allocate(ctx, lbls, record, true)
}

func (b *Backend) allocate(ctx context.Context, lbls labels.Labels, record func(*globalstore.Reference), create bool) (identity.NumericIdentity, bool, error) {
	b.Requests.Add(1)
	if b.store.Down.Load() {
		return 0, false, ErrDown
	}
	if err := b.store.stall(ctx); err != nil {
		return 0, false, err
	}
	s := b.store
	key := lbls.Canonical()
	s.mu.Lock()
	defer s.mu.Unlock()
	id, ok := s.byKey[key]
	created := false
	if !ok && !create {
		return 0, false, fmt.Errorf("adopting %s: %w", lbls, globalstore.ErrNoIdentity)
	}
	if !ok {
		nid := s.pool.AllocateID()
		if nid == idpool.NoID {
			return 0, false, globalstore.ErrSpaceExhausted
		}
		id = identity.NumericIdentity(nid)
		s.byKey[key] = id
		s.byID[id] = lbls
		created = true
		s.broadcast(func(ev globalstore.Events) { ev.Upsert(id, lbls) })
	}
	if s.refs[key] == nil {
		s.refs[key] = map[string]struct{}{}
	}
	s.refs[key][b.node] = struct{}{}
	record(globalstore.NewReference(id, lbls, 0))
	return id, created, nil
}

// Adopt implements globalstore.Backend.
func (b *Backend) Adopt(ctx context.Context, lbls labels.Labels, record func(*globalstore.Reference)) (identity.NumericIdentity, error) {
	id, _, err := b.allocate(ctx, lbls, record, false)
	return id, err
}

// Release implements globalstore.Backend.
func (b *Backend) Release(ctx context.Context, ref *globalstore.Reference) error {
	b.Requests.Add(1)
	if b.store.Down.Load() {
		return ErrDown
	}
	if err := b.store.stall(ctx); err != nil {
		return err
	}
	s := b.store
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.refs[ref.Labels.Canonical()], b.node)
	return nil
}

// stall waits for ctx to end while the store is stalled, and returns
// ctx's error.
func (s *Store) stall(ctx context.Context) error {
	if s.Stalled.Load() {
		<-ctx.Done()
	}
	return ctx.Err()
}

// GC deletes identities no node holds, as the kvstore's GC does.
func (s *Store) GC() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for key, id := range s.byKey {
		if len(s.refs[key]) > 0 {
			continue
		}
		lbls := s.byID[id]
		delete(s.byKey, key)
		delete(s.byID, id)
		delete(s.refs, key)
		s.pool.Insert(idpool.ID(id))
		s.broadcast(func(ev globalstore.Events) { ev.Delete(id, lbls) })
		n++
	}
	return n
}

// LookupByID implements globalstore.Backend.
func (b *Backend) LookupByID(id identity.NumericIdentity) (labels.Labels, bool) {
	b.store.mu.Lock()
	defer b.store.mu.Unlock()
	l, ok := b.store.byID[id]
	return l, ok
}

// LookupByLabels implements globalstore.Backend.
func (b *Backend) LookupByLabels(lbls labels.Labels) (identity.NumericIdentity, bool) {
	b.store.mu.Lock()
	defer b.store.mu.Unlock()
	id, ok := b.store.byKey[lbls.Canonical()]
	return id, ok
}

// start lists the store to events, then reports its changes.
func (b *Backend) start(events globalstore.Events) {
	b.store.mu.Lock()
	defer b.store.mu.Unlock()
	for id, l := range b.store.byID {
		events.Upsert(id, l)
	}
	b.mu.Lock()
	b.events = events
	b.mu.Unlock()
	events.Synced()
}

func (b *Backend) stop() {
	b.mu.Lock()
	b.events = nil
	b.mu.Unlock()
}

// register makes b start and stop with the hive, reporting to sink, as a
// store cell's hooks do.
func (b *Backend) register(lc cell.Lifecycle, sink *globalstore.Sink) {
	lc.Append(cell.Hook{
		OnStart: func(cell.HookContext) error { b.start(sink); return nil },
		OnStop:  func(cell.HookContext) error { b.stop(); return nil },
	})
}

// DriverCell stands in for a store cell: it offers b to the allocator as
// the globalstore.Driver of mode, as etcdstore.Cell does for kvstore mode
// and crdstore.Cell for crd mode, and starts it with the hive, reporting
// to the globalstore.Sink of mode.
func DriverCell(mode identity.AllocationMode, b *Backend) cell.Cell {
	return cell.Provide(func(lc cell.Lifecycle, sinks *globalstore.Sinks) globalstore.DriverOut {
		b.register(lc, sinks.For(mode))
		return globalstore.NewDriver(mode, b)
	})
}

// BackendCell gives the allocator b as its globalstore.Backend, whatever
// the configured mode, and starts it with the hive.
func BackendCell(b *Backend) cell.Cell {
	return cell.Provide(func(lc cell.Lifecycle, sinks *globalstore.Sinks, mode identity.AllocationMode) globalstore.Backend {
		b.register(lc, sinks.For(mode))
		return b
	})
}
