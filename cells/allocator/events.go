package allocator

import (
	"context"
	"sync"
	"time"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/idtable"
)

// event is one identity change as queued by the allocation paths.
type event struct {
	kind  ChangeKind
	ident *identity.Identity
	// ref is this node's reference entry of the identity, if it has one.
	ref *refEntry
	// source is the table source of identities without a ref.
	source Source
}

// eventQueue collects changes from the allocation paths. Pushing is a short
// critical section, so that allocations never wait for observers, handlers
// or the identities table: the dispatcher and the table writer deliver to
// those on their own goroutines.
type eventQueue struct {
	mu sync.Mutex
	// pending is a list of fixed-size chunks: appending never copies the
	// events already queued, however far the dispatcher lags behind.
	pending [][]event
	// free holds drained full-size chunks for reuse, so that a busy
	// allocator does not turn every event into garbage.
	free  [][]event
	holds int
	wake  chan struct{}

	table *tableWriter
}

func newEventQueue(table *tableWriter) *eventQueue {
	return &eventQueue{wake: make(chan struct{}, 1), table: table}
}

// eventChunk is the number of events per chunk of the queue, and
// firstEventChunk the size of the first chunk after the dispatcher took
// the queue.
const (
	eventChunk      = 512
	firstEventChunk = 16
)

func (q *eventQueue) pushEvent(ev event) {
	q.mu.Lock()
	// Only the first event after a take wakes the dispatcher: it takes
	// everything queued, and a wake-up for each event would cost a
	// channel operation per allocation.
	first := len(q.pending) == 0
	if first || len(q.pending[len(q.pending)-1]) == cap(q.pending[len(q.pending)-1]) {
		q.pending = append(q.pending, q.newChunk(first))
	}
	last := &q.pending[len(q.pending)-1]
	*last = append(*last, ev)
	q.mu.Unlock()
	if first {
		q.signal()
	}
}

// newChunk returns an empty chunk, a recycled one if there is one. The
// caller holds mu.
func (q *eventQueue) newChunk(first bool) []event {
	if n := len(q.free); n > 0 {
		c := q.free[n-1]
		q.free[n-1] = nil
		q.free = q.free[:n-1]
		return c
	}
	if first {
		// The dispatcher usually takes the queue within a few
		// events: a full chunk for each would be mostly garbage.
		return make([]event, 0, firstEventChunk)
	}
	return make([]event, 0, eventChunk)
}

// maxFreeChunks bounds the chunks kept for reuse (about 1.3 MB).
const maxFreeChunks = 64

// recycle takes back drained chunks for reuse. It keeps no more than the
// drain took: the allocations until the next drain need about as many,
// and a queue that has gone quiet after a burst does not keep the burst's
// chunks.
func (q *eventQueue) recycle(chunks [][]event) {
	q.mu.Lock()
	defer q.mu.Unlock()
	keep := min(len(chunks), maxFreeChunks)
	if len(q.free) > keep {
		clear(q.free[keep:])
		q.free = q.free[:keep]
	}
	for _, c := range chunks {
		if cap(c) != eventChunk || len(q.free) == keep {
			continue
		}
		// Drop the references, so that a recycled chunk keeps no
		// released entry alive.
		clear(c)
		q.free = append(q.free, c[:0])
	}
}

func (q *eventQueue) signal() {
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

// touch tells the identities table that an entry's count changed.
func (q *eventQueue) touch(e *refEntry) { q.table.touch(e) }

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

func (q *eventQueue) take() [][]event {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.holds > 0 {
		return nil
	}
	evs := q.pending
	q.pending = nil
	return evs
}

// allEvents iterates over the events of a list of chunks.
func allEvents(chunks [][]event) func(func(int, event) bool) {
	return func(yield func(int, event) bool) {
		i := 0
		for _, c := range chunks {
			for _, ev := range c {
				if !yield(i, ev) {
					return
				}
				i++
			}
		}
	}
}

// dispatcher turns queued changes into Observe events and handler batches,
// and forwards them to the table writer. It runs on one goroutine, so
// handler calls are serialized and in order.
type dispatcher struct {
	queue    *eventQueue
	handlers []Handler

	mu sync.Mutex
	// touched is the scratch list of entries to hand to the table,
	// kept between drains.
	touched []*refEntry
	// state is the set of identities delivered.
	state  idtable.Map[identity.Identity]
	subs   map[*subscriber]struct{}
	synced bool
	closed bool
}

func newDispatcher(q *eventQueue, handlers []Handler) *dispatcher {
	return &dispatcher{
		queue:    q,
		handlers: handlers,
		subs:     map[*subscriber]struct{}{},
	}
}

// syncEvent is queued when the global identities were first listed; it is
// ordered after the listed identities, so Observe's sync marker is too.
var syncEvent = event{kind: ChangeSync}

func (d *dispatcher) run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			d.drain()
			d.close()
			return
		case <-d.queue.wake:
			if d.drain() < dispatchBurst {
				continue
			}
			// A burst: let changes gather for a moment, so that
			// the allocating goroutines fill the queue without
			// handing every few events (and their cache lines)
			// over to this one. Handlers get bigger batches; a
			// change waits at most dispatchBurstPause longer.
			select {
			case <-ctx.Done():
			case <-time.After(dispatchBurstPause):
			}
		}
	}
}

// maxScratch bounds the capacity of the lists kept for reuse between
// drains and flushes (512 KiB of pointers).
const maxScratch = 1 << 16

// reusable reports whether a scratch list whose last use filled used of
// it is worth keeping: not beyond maxScratch, and not when the work has
// shrunk to a quarter of it, so that a quiet allocator does not keep a
// burst's lists.
func reusable(capacity, used int) bool {
	return capacity <= maxScratch && 4*used >= capacity
}

// A drain of at least dispatchBurst changes makes the dispatcher pause for
// dispatchBurstPause before the next one.
const (
	dispatchBurst      = 256
	dispatchBurstPause = time.Millisecond
)

// drain delivers everything queued and returns how many changes it took.
func (d *dispatcher) drain() int {
	chunks := d.queue.take()
	if len(chunks) == 0 {
		return 0
	}
	taken := 0
	for _, c := range chunks {
		taken += len(c)
	}
	d.mu.Lock()
	// Handler batches and observer events are only built when someone
	// consumes them: a busy allocator queues many changes per drain.
	wantBatch, wantOut := len(d.handlers) > 0, len(d.subs) > 0
	var added, deleted IdentityMap
	if wantBatch {
		added, deleted = IdentityMap{}, IdentityMap{}
	}
	// The table learns of held entries' changes in one call per drain.
	touched := d.touched[:0]
	var out []Change
	if wantOut {
		out = make([]Change, 0, len(chunks)*eventChunk)
	}
	for _, ev := range allEvents(chunks) {
		switch ev.kind {
		case ChangeSync:
			if d.synced {
				continue
			}
			d.synced = true
			if wantOut {
				out = append(out, Change{Kind: ChangeSync})
			}
			continue
		case ChangeUpsert:
			id := ev.ident
			if ev.ref != nil {
				touched = append(touched, ev.ref)
			}
			if old := d.state.Get(id.ID); old != nil && old.Labels.Equal(id.Labels) {
				continue // a watch echo of an identity already known
			}
			d.state.Set(id.ID, id)
			if wantBatch {
				if old, ok := deleted[id.ID]; ok && old.Equal(id.Labels) {
					delete(deleted, id.ID)
				} else {
					added[id.ID] = id.Labels
				}
			}
		case ChangeDelete:
			id := ev.ident
			if ev.ref != nil {
				touched = append(touched, ev.ref)
			}
			if d.state.Get(id.ID) == nil {
				continue
			}
			d.state.Set(id.ID, nil)
			if wantBatch {
				if _, ok := added[id.ID]; ok {
					delete(added, id.ID)
				} else {
					deleted[id.ID] = id.Labels
				}
			}
		}
		if wantOut {
			out = append(out, Change{Kind: ev.kind, ID: ev.ident.ID, Labels: ev.ident.Labels})
		}
		if ev.ref == nil {
			d.queue.table.apply(ev)
		}
	}
	for s := range d.subs {
		s.push(out...)
	}
	d.queue.table.touchAll(touched)
	clear(touched)
	d.touched = nil
	if reusable(cap(touched), len(touched)) {
		d.touched = touched[:0]
	}
	d.mu.Unlock()
	d.queue.recycle(chunks)

	if len(added) > 0 || len(deleted) > 0 {
		for _, h := range d.handlers {
			h.UpdateIdentities(added, deleted)
		}
	}
	return taken
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
	out := make([]*identity.Identity, 0, d.state.Len())
	d.state.Each(func(id *identity.Identity) { out = append(out, id) })
	return out
}

// lookup returns the delivered identity of id, or nil.
func (d *dispatcher) lookup(id identity.NumericIdentity) *identity.Identity {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.state.Get(id)
}

func (d *dispatcher) known(id identity.NumericIdentity) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.state.Get(id) != nil
}

// Observe implements stream.Observable[Change].
func (d *dispatcher) Observe(ctx context.Context, next func(Change), complete func(error)) {
	s := &subscriber{wake: make(chan struct{}, 1)}
	d.mu.Lock()
	replay := make([]Change, 0, d.state.Len()+1)
	d.state.Each(func(id *identity.Identity) {
		replay = append(replay, Change{Kind: ChangeUpsert, ID: id.ID, Labels: id.Labels})
	})
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
