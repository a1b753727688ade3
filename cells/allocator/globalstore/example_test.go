package globalstore_test

import (
	"context"
	"fmt"
	"log/slog"
	"sync"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// memStore is a driver whose shared store is a map in memory: a sketch of
// what etcdstore and crdstore do against a store the nodes share.
type memStore struct {
	mu     sync.Mutex
	byKey  map[string]identity.NumericIdentity
	byID   map[identity.NumericIdentity]labels.Labels
	next   identity.NumericIdentity
	calls  int
	events globalstore.Events
}

func (s *memStore) Allocate(_ context.Context, lbls labels.Labels, record func(*globalstore.Reference)) (identity.NumericIdentity, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls++
	id, ok := s.byKey[lbls.Canonical()]
	if !ok {
		id = s.next
		s.next++
		s.byKey[lbls.Canonical()], s.byID[id] = id, lbls
	}
	// A real store writes this node's reference here, and keeps in the
	// token what its release needs (etcdstore: the key's revision).
	record(globalstore.NewReference(id, lbls, 0))
	return id, !ok, nil
}

func (s *memStore) Adopt(ctx context.Context, lbls labels.Labels, record func(*globalstore.Reference)) (identity.NumericIdentity, error) {
	if _, ok := s.LookupByLabels(lbls); !ok {
		return 0, globalstore.ErrNoIdentity
	}
	id, _, err := s.Allocate(ctx, lbls, record)
	return id, err
}

func (s *memStore) Release(context.Context, *globalstore.Reference) error { return nil }

func (s *memStore) LookupByID(id identity.NumericIdentity) (labels.Labels, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	l, ok := s.byID[id]
	return l, ok
}

func (s *memStore) LookupByLabels(lbls labels.Labels) (identity.NumericIdentity, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	id, ok := s.byKey[lbls.Canonical()]
	return id, ok
}

// register starts the store with the hive. A real store lists, reports
// every identity to its Sink, and watches, in jobs of its own.
func (s *memStore) register(lc cell.Lifecycle, sink *globalstore.Sink) {
	lc.Append(cell.Hook{OnStart: func(cell.HookContext) error {
		s.events = sink
		sink.Synced()
		return nil
	}})
}

// A driver offers its Backend for an allocation mode; the allocator uses
// the driver of the configured --identity-allocation-mode, and imports no
// driver itself. The store's cell starts it and reports to the Sink of its
// mode, which the allocator binds.
func Example() {
	store := &memStore{byKey: map[string]identity.NumericIdentity{}, byID: map[identity.NumericIdentity]labels.Labels{}, next: 1000}
	var a allocator.Allocator
	h := hive.New(job.Cell, statedb.Cell, allocator.Cell,
		cell.Provide(func(lc cell.Lifecycle, sinks *globalstore.Sinks) globalstore.DriverOut {
			store.register(lc, sinks.For(identity.AllocationModeKVStore))
			return globalstore.NewDriver(identity.AllocationModeKVStore, store)
		}),
		cell.Invoke(func(x allocator.Allocator) { a = x }))
	log := slog.New(slog.DiscardHandler)
	ctx := context.Background()
	if err := h.Start(log, ctx); err != nil {
		panic(err)
	}
	defer h.Stop(log, ctx)

	web := labels.MustParse("k8s:app=web", "k8s:io.kubernetes.pod.namespace=default")
	id, allocated, err := a.Allocate(ctx, web)
	if err != nil {
		panic(err)
	}
	fmt.Println(id.ID, allocated)
	// A label set the allocator holds costs the store nothing.
	again, allocated, _ := a.Allocate(ctx, web)
	fmt.Println(again.ID, allocated)
	store.mu.Lock()
	fmt.Println("store calls:", store.calls)
	store.mu.Unlock()
	// Output:
	// 1000 true
	// 1000 false
	// store calls: 1
}
