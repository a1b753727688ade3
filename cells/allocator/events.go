package allocator

import (
	"context"
	"slices"
	"sync"

	"github.com/cilium/statedb"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// event is a Change with what the identities table needs to know of it.
type event struct {
	Change
	ref    *refEntry
	source Source
}

// eventQueue collects changes from the allocation paths. Pushing is a short
// critical section, so that allocations never wait for observers, handlers
// or the identities table: the dispatcher delivers to those.
type eventQueue struct {
	mu      sync.Mutex
	pending []event
	dirty   []*refEntry
	holds   int
	wake    chan struct{}
}

func newEventQueue() *eventQueue {
	return &eventQueue{wake: make(chan struct{}, 1)}
}

func (q *eventQueue) push(c Change) { q.pushEvent(event{Change: c}) }

func (q *eventQueue) pushEvent(ev event) {
	q.mu.Lock()
	q.pending = append(q.pending, ev)
	q.mu.Unlock()
	q.signal()
}

// touch queues an entry whose reference count changed, once until the
// dispatcher has looked at it.
func (q *eventQueue) touch(e *refEntry) {
	if e.dirty.Load() || !e.dirty.CompareAndSwap(false, true) {
		return
	}
	q.mu.Lock()
	q.dirty = append(q.dirty, e)
	q.mu.Unlock()
	q.signal()
}

func (q *eventQueue) signal() {
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

// hold keeps the dispatcher from taking changes until release, so that the
// changes of a batch reach the handlers in one call.
func (q *eventQueue) hold() {
	q.mu.Lock()
	q.holds++
	q.mu.Unlock()
}

func (q *eventQueue) release() {
	q.mu.Lock()
	q.holds--
	q.mu.Unlock()
	q.signal()
}

func (q *eventQueue) take() ([]event, []*refEntry) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.holds > 0 {
		return nil, nil
	}
	evs, dirty := q.pending, q.dirty
	q.pending, q.dirty = nil, nil
	return evs, dirty
}

// dispatcher turns queued changes into Observe events, handler batches and
// identities-table rows. It runs on one goroutine, so handler calls and
// table writes are serialized and in order.
type dispatcher struct {
	queue    *eventQueue
	handlers []Handler
	db       *statedb.DB
	table    statedb.RWTable[Entry]

	mu     sync.Mutex
	state  map[identity.NumericIdentity]labels.Labels
	subs   map[*subscriber]struct{}
	synced bool
	closed bool
}

func newDispatcher(q *eventQueue, handlers []Handler, db *statedb.DB, table statedb.RWTable[Entry]) *dispatcher {
	return &dispatcher{
		queue:    q,
		handlers: handlers,
		db:       db,
		table:    table,
		state:    map[identity.NumericIdentity]labels.Labels{},
		subs:     map[*subscriber]struct{}{},
	}
}

// syncEvent is queued when the global identities were first listed; it is
// ordered after the listed identities, so Observe's sync marker is too.
var syncEvent = event{Change: Change{Kind: ChangeSync}}

func (d *dispatcher) run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			d.drain()
			d.close()
			return
		case <-d.queue.wake:
			d.drain()
		}
	}
}

// drain delivers everything queued. It reports whether anything was taken.
func (d *dispatcher) drain() bool {
	evs, dirty := d.queue.take()
	if len(evs) == 0 && len(dirty) == 0 {
		return false
	}
	added, deleted := IdentityMap{}, IdentityMap{}
	out := make([]Change, 0, len(evs))
	applied := evs[:0]

	d.mu.Lock()
	for _, ev := range evs {
		switch ev.Kind {
		case ChangeSync:
			if d.synced {
				continue
			}
			d.synced = true
		case ChangeUpsert:
			if old, ok := d.state[ev.ID]; ok && old.Equal(ev.Labels) {
				// A watch echo of a known identity; it may still tell
				// the table that this node holds it.
				if ev.ref != nil {
					applied = append(applied, ev)
				}
				continue
			}
			d.state[ev.ID] = ev.Labels
			if old, ok := deleted[ev.ID]; ok && old.Equal(ev.Labels) {
				delete(deleted, ev.ID)
			} else {
				added[ev.ID] = ev.Labels
			}
		case ChangeDelete:
			if _, ok := d.state[ev.ID]; !ok {
				continue
			}
			delete(d.state, ev.ID)
			if _, ok := added[ev.ID]; ok {
				delete(added, ev.ID)
			} else {
				deleted[ev.ID] = ev.Labels
			}
		}
		out = append(out, ev.Change)
		applied = append(applied, ev)
	}
	for s := range d.subs {
		s.push(out...)
	}
	d.mu.Unlock()

	if len(added) > 0 || len(deleted) > 0 {
		for _, h := range d.handlers {
			h.UpdateIdentities(added, deleted)
		}
	}
	d.writeTable(applied, dirty)
	return true
}

func (d *dispatcher) writeTable(evs []event, dirty []*refEntry) {
	if d.table == nil {
		return
	}
	txn := d.db.WriteTxn(d.table)
	for _, ev := range evs {
		switch ev.Kind {
		case ChangeUpsert:
			if ev.ref == nil {
				// Keep the row of an identity this node holds when the
				// store reports it again.
				if old, _, ok := d.table.Get(txn, EntryIDIndex.Query(ev.ID)); ok && old.ref != nil && old.Identity.Labels.Equal(ev.Labels) {
					continue
				}
			}
			d.table.Insert(txn, entryOf(&identity.Identity{ID: ev.ID, Labels: ev.Labels}, ev.ref, ev.source))
		case ChangeDelete:
			d.table.Delete(txn, Entry{Identity: &identity.Identity{ID: ev.ID}})
		}
	}
	for _, e := range dirty {
		e.dirty.Store(false)
		row, _, ok := d.table.Get(txn, EntryIDIndex.Query(e.ident.ID))
		if !ok || row.ref != e {
			continue
		}
		d.table.Insert(txn, entryOf(row.Identity, e, row.Source))
	}
	txn.Commit()
}

// entryOf builds a table row; ref is the node's reference entry, if any.
func entryOf(id *identity.Identity, ref *refEntry, source Source) Entry {
	e := Entry{Identity: id, Source: source, ref: ref}
	if ref != nil {
		e.Identity = &ref.ident
		e.RefCount = int(ref.refs.Load())
		if source == SourceLocal && ref.restored.Load() {
			e.Source = SourceRestored
		}
	}
	return e
}

func (d *dispatcher) close() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.closed = true
	for s := range d.subs {
		s.finish()
	}
	clear(d.subs)
}

func (d *dispatcher) snapshot() []*identity.Identity {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make([]*identity.Identity, 0, len(d.state))
	for id, l := range d.state {
		out = append(out, &identity.Identity{ID: id, Labels: l})
	}
	return out
}

// Observe implements stream.Observable[Change].
func (d *dispatcher) Observe(ctx context.Context, next func(Change), complete func(error)) {
	s := &subscriber{wake: make(chan struct{}, 1)}
	d.mu.Lock()
	ids := make([]identity.NumericIdentity, 0, len(d.state))
	for id := range d.state {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	replay := make([]Change, 0, len(ids)+1)
	for _, id := range ids {
		replay = append(replay, Change{Kind: ChangeUpsert, ID: id, Labels: d.state[id]})
	}
	if d.synced {
		replay = append(replay, Change{Kind: ChangeSync})
	}
	s.push(replay...)
	if d.closed {
		s.finish()
	} else {
		d.subs[s] = struct{}{}
	}
	d.mu.Unlock()

	go func() {
		err := s.run(ctx, next)
		d.mu.Lock()
		delete(d.subs, s)
		d.mu.Unlock()
		complete(err)
	}()
}

// subscriber buffers changes for one observer, so that a slow observer
// delays only itself.
type subscriber struct {
	mu    sync.Mutex
	queue []Change
	done  bool
	wake  chan struct{}
}

func (s *subscriber) push(cs ...Change) {
	if len(cs) == 0 {
		return
	}
	s.mu.Lock()
	s.queue = append(s.queue, cs...)
	s.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

func (s *subscriber) finish() {
	s.mu.Lock()
	s.done = true
	s.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

func (s *subscriber) run(ctx context.Context, next func(Change)) error {
	for {
		s.mu.Lock()
		batch, done := s.queue, s.done
		s.queue = nil
		s.mu.Unlock()
		for _, c := range batch {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			next(c)
		}
		if done && len(batch) == 0 {
			return nil
		}
		if len(batch) > 0 {
			continue
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-s.wake:
		}
	}
}
