package allocator

import (
	"context"
	"sync"
	"time"

	"github.com/cilium/statedb"

	"github.com/identityd/identityd/identity"
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
	state   identityState
	subs    map[*subscriber]struct{}
	synced  bool
	closed  bool
}

func newDispatcher(q *eventQueue, handlers []Handler) *dispatcher {
	return &dispatcher{
		queue:    q,
		handlers: handlers,
		state:    newIdentityState(),
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
			if old, ok := d.state.get(id.ID); ok && old.Labels.Equal(id.Labels) {
				continue // a watch echo of an identity already known
			}
			d.state.set(id)
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
			if _, ok := d.state.get(id.ID); !ok {
				continue
			}
			d.state.delete(id.ID)
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
	out := make([]*identity.Identity, 0, d.state.len())
	d.state.each(func(id *identity.Identity) { out = append(out, id) })
	return out
}

// lookup returns the delivered identity of id, or nil.
func (d *dispatcher) lookup(id identity.NumericIdentity) *identity.Identity {
	d.mu.Lock()
	defer d.mu.Unlock()
	ident, _ := d.state.get(id)
	return ident
}

func (d *dispatcher) known(id identity.NumericIdentity) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	_, ok := d.state.get(id)
	return ok
}

// Observe implements stream.Observable[Change].
func (d *dispatcher) Observe(ctx context.Context, next func(Change), complete func(error)) {
	s := &subscriber{wake: make(chan struct{}, 1)}
	d.mu.Lock()
	replay := make([]Change, 0, d.state.len()+1)
	d.state.each(func(id *identity.Identity) {
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

// tableWriterInterval is the least time between two writes of the
// identities table. The table is for operators and other cells to read;
// coalescing keeps a busy allocator from spending a core on it: an entry
// that changes many times between two writes is written once.
const tableWriterInterval = 10 * time.Millisecond

// tableWriterRestFactor bounds the table writer's share of a core to
// 1/(1+tableWriterRestFactor).
const tableWriterRestFactor = 3

// tableWriterChunk is the most rows one write transaction of the table
// writer holds (about a millisecond of statedb writes). A burst of new
// identities is written in many short transactions with rests in between
// rather than in a few long ones: a long one keeps a processor busy for a
// tenth of a second and more, and on a small machine the dispatcher and
// the garbage collector's workers then take the processors of the
// allocating goroutines (docs/benchmarks.md).
const tableWriterChunk = 1024

// tableWriterSkipFactor bounds the entries a chunk looks at to this many
// times tableWriterChunk: entries that need no row cost no write, but
// looking at them still takes time under the writer's lock.
const tableWriterSkipFactor = 16

// tableWriter keeps the identities table in step with the allocator. Held
// identities reach it as dirty entries (their current count is written),
// the others (reserved, other nodes' global ones) as events.
type tableWriter struct {
	db       *statedb.DB
	table    statedb.RWTable[Entry]
	interval time.Duration
	// known reports whether an identity still exists, for global
	// identities this node stopped holding.
	known func(identity.NumericIdentity) bool

	mu    sync.Mutex
	dirty []*refEntry
	evs   []event
	wake  chan struct{}

	// writeMu serializes writing; it guards the backlog: what the
	// writer took from dirty and evs and has not written yet.
	writeMu      sync.Mutex
	backlogEvs   []event
	backlogDirty []*refEntry
	// written is how many of backlogDirty were written.
	written int
}

func newTableWriter(db *statedb.DB, table statedb.RWTable[Entry]) *tableWriter {
	return &tableWriter{db: db, table: table, interval: tableWriterInterval, wake: make(chan struct{}, 1)}
}

func (w *tableWriter) touch(e *refEntry) {
	if w.table == nil || !e.markDirty() {
		return
	}
	w.mu.Lock()
	w.dirty = append(w.dirty, e)
	w.mu.Unlock()
	w.signal()
}

// touchAll is touch for the entries of a dispatcher drain, with one lock.
func (w *tableWriter) touchAll(es []*refEntry) {
	if w.table == nil || len(es) == 0 {
		return
	}
	w.mu.Lock()
	for _, e := range es {
		if e.markDirty() {
			w.dirty = append(w.dirty, e)
		}
	}
	w.mu.Unlock()
	w.signal()
}

func (w *tableWriter) apply(ev event) {
	if w.table == nil {
		return
	}
	w.mu.Lock()
	w.evs = append(w.evs, ev)
	w.mu.Unlock()
	w.signal()
}

func (w *tableWriter) signal() {
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

func (w *tableWriter) run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			w.flush()
			return
		case <-w.wake:
		}
		for more := true; more; {
			start := time.Now()
			more = w.writeChunk(tableWriterChunk, true)
			// Rest three times as long as the chunk took: under a
			// sustained burst the mirror lags further behind (and
			// catches up after it) instead of taking more than a
			// quarter of a core from the allocations it mirrors. A
			// row costs about a microsecond of statedb writes,
			// several times an allocation. With nothing left, rest
			// at least the interval, so that changes coalesce.
			rest := tableWriterRestFactor * time.Since(start)
			if !more {
				rest = max(w.interval, rest)
			}
			select {
			case <-ctx.Done():
				w.flush()
				return
			case <-time.After(rest):
			}
		}
	}
}

// flush writes the rest of the backlog, then takes what is queued once
// and writes it, without resting. Changes queued while it writes that
// wait for the next flush, so that allocations that go on during a stop
// cannot keep it writing.
func (w *tableWriter) flush() {
	for w.writeChunk(tableWriterChunk, false) {
	}
	if w.writeChunk(tableWriterChunk, true) {
		for w.writeChunk(tableWriterChunk, false) {
		}
	}
}

// writeChunk writes up to limit rows of the backlog in one transaction;
// when the backlog is empty and take is set, it takes what is queued
// first. It reports whether rows are left in the backlog.
func (w *tableWriter) writeChunk(limit int, take bool) bool {
	w.writeMu.Lock()
	defer w.writeMu.Unlock()
	if len(w.backlogEvs) == 0 && w.written == len(w.backlogDirty) {
		if !take {
			return false
		}
		w.takeBacklog()
	}
	if len(w.backlogEvs) == 0 && w.written == len(w.backlogDirty) {
		return false
	}
	// The transaction is opened for the first row: a chunk of entries
	// that came and went before the writer saw them writes nothing.
	var txn statedb.WriteTxn
	n := min(limit, len(w.backlogEvs))
	if n > 0 {
		txn = w.db.WriteTxn(w.table)
	}
	for _, ev := range w.backlogEvs[:n] {
		w.writeEvent(txn, ev)
	}
	clear(w.backlogEvs[:n])
	w.backlogEvs = w.backlogEvs[n:]
	dirty := w.backlogDirty[w.written:]
	dirty = dirty[:min(tableWriterSkipFactor*limit, len(dirty))]
	rows := n
	for i, e := range dirty {
		if rows == limit {
			dirty = dirty[:i]
			break
		}
		if w.rowless(e) {
			continue
		}
		if txn == nil {
			txn = w.db.WriteTxn(w.table)
		}
		w.writeEntry(txn, e)
		rows++
	}
	clear(dirty)
	w.written += len(dirty)
	if txn != nil {
		txn.Commit()
	}
	if len(w.backlogEvs) > 0 || w.written < len(w.backlogDirty) {
		return true
	}
	// Written: the lists are let go now rather than at the next take,
	// which may be long after a burst. The dirty list goes back for
	// the next one unless it is much bigger than the work needs.
	w.backlogEvs = nil
	if !reusable(cap(w.backlogDirty), len(w.backlogDirty)) {
		w.backlogDirty = nil
	}
	w.backlogDirty, w.written = w.backlogDirty[:0], 0
	return false
}

// takeBacklog moves what is queued to the backlog; the caller holds
// writeMu and has written the previous backlog.
func (w *tableWriter) takeBacklog() {
	// The list goes back for the next burst (its references cleared as
	// they were written, and dropped if too big when it was written).
	done := w.backlogDirty[:0]
	w.mu.Lock()
	w.backlogDirty, w.backlogEvs = w.dirty, w.evs
	w.dirty, w.evs = done, nil
	w.mu.Unlock()
	w.written = 0
}

func (w *tableWriter) writeEvent(txn statedb.WriteTxn, ev event) {
	switch ev.kind {
	case ChangeUpsert:
		// A held identity's row is written from its entry.
		if old, _, ok := w.table.Get(txn, EntryIDIndex.Query(ev.ident.ID)); ok && old.ref != nil {
			return
		}
		w.table.Insert(txn, Entry{Identity: ev.ident, Source: ev.source})
	case ChangeDelete:
		w.table.Delete(txn, Entry{Identity: ev.ident})
	}
}

// rowless reports whether e needs no write: a local entry released before
// any row was written from it. Under churn most entries are, and each
// would otherwise cost a lookup in a write transaction, which kept the
// writer so far behind that released entries piled up in its backlog.
// A released entry is never taken again, so the answer cannot change.
func (w *tableWriter) rowless(e *refEntry) bool {
	f := e.flags.Load()
	if f&(entryGlobal|entryInTable) != 0 || e.refs.Load() > 0 {
		return false
	}
	e.flags.And(^entryDirty)
	return true
}

func (w *tableWriter) writeEntry(txn statedb.WriteTxn, e *refEntry) {
	e.flags.And(^entryDirty)
	if e.refs.Load() > 0 {
		// A held entry's row is its current state; it also replaces
		// the row of an older entry of the same ID that was released
		// meanwhile.
		w.table.Insert(txn, entryOf(e))
		e.flags.Or(entryInTable)
		return
	}
	old, _, hadOld := w.table.Get(txn, EntryIDIndex.Query(e.ident.ID))
	switch {
	case hadOld && old.ref != e:
		// The ID was reused by a newer entry; leave its row.
	case e.global() && w.known(e.ident.ID):
		// This node let go, but the identity still exists.
		w.table.Insert(txn, Entry{Identity: &e.ident, Source: SourceGlobal})
	case hadOld:
		w.table.Delete(txn, old)
		e.flags.And(^entryInTable)
	}
}

// entryOf builds the table row of a held identity.
func entryOf(ref *refEntry) Entry {
	e := Entry{Identity: &ref.ident, RefCount: int(ref.refs.Load()), ref: ref, Source: SourceLocal}
	switch {
	case ref.global():
		e.Source = SourceGlobal
	case ref.restored():
		e.Source = SourceRestored
	}
	return e
}
