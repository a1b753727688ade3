// Package tablewriter keeps a statedb table in step with state that
// changes faster than it is worth writing. Its owner queues changes of two
// kinds, events (each written as it came) and dirty objects (written with
// their state at the time of the write, so that one that changed many
// times costs one row); the writer takes what is queued and writes it in
// transactions of a bounded number of rows, with rests between them, so
// that it takes a bounded share of a processor however fast changes come,
// and lags behind during a burst instead. The allocator's identities table
// is written this way.
package tablewriter

import (
	"context"
	"sync"
	"time"

	"github.com/cilium/statedb"
)

// Rows is what the owner knows of its table: how to write each change.
type Rows[E, D any] interface {
	// WriteEvent writes the row of an event.
	WriteEvent(txn statedb.WriteTxn, ev E)
	// Rowless reports whether d needs no write at all, so that a chunk
	// passes over it without a transaction; it is called without one.
	Rowless(d D) bool
	// WriteDirty writes d's row as d is now.
	WriteDirty(txn statedb.WriteTxn, d D)
}

// Pace bounds the writer's work.
type Pace struct {
	// Interval is the least time between two writes, so that changes
	// coalesce.
	Interval time.Duration
	// ChunkRows is the most rows one transaction holds.
	ChunkRows int
	// SkipFactor bounds the dirty objects a chunk looks at to this many
	// times ChunkRows: rowless ones cost no write, but looking at them
	// still takes time under the writer's lock.
	SkipFactor int
	// RestFactor bounds the writer's share of a core to
	// 1/(1+RestFactor): after each chunk it rests this many times as
	// long as the chunk took.
	RestFactor int
}

// Writer writes the changes queued by its owner.
type Writer[E, D any] struct {
	db    *statedb.DB
	table statedb.TableMeta
	rows  Rows[E, D]
	pace  Pace

	mu    sync.Mutex
	dirty []D
	evs   []E
	wake  chan struct{}

	// writeMu serializes writing; it guards the backlog: what the
	// writer took from dirty and evs and has not written yet.
	writeMu      sync.Mutex
	backlogEvs   []E
	backlogDirty []D
	// written is how many of backlogDirty were written.
	written int
}

// New returns a writer of table; it writes once Run runs (or WriteChunk
// or Flush is called).
func New[E, D any](db *statedb.DB, table statedb.TableMeta, rows Rows[E, D], pace Pace) *Writer[E, D] {
	return &Writer[E, D]{db: db, table: table, rows: rows, pace: pace, wake: make(chan struct{}, 1)}
}

// AddDirty queues d; the owner queues an object again only once it was
// written (it keeps a mark of its own), so that a hot object is queued
// once.
func (w *Writer[E, D]) AddDirty(d D) {
	w.mu.Lock()
	w.dirty = append(w.dirty, d)
	w.mu.Unlock()
	w.signal()
}

// AddDirtyFunc is AddDirty, with one lock, for each of ds for which add
// (called under the lock) reports true.
func (w *Writer[E, D]) AddDirtyFunc(ds []D, add func(D) bool) {
	w.mu.Lock()
	for _, d := range ds {
		if add(d) {
			w.dirty = append(w.dirty, d)
		}
	}
	w.mu.Unlock()
	w.signal()
}

// AddEvent queues ev.
func (w *Writer[E, D]) AddEvent(ev E) {
	w.mu.Lock()
	w.evs = append(w.evs, ev)
	w.mu.Unlock()
	w.signal()
}

// Queued reports whether changes wait to be taken into the backlog.
func (w *Writer[E, D]) Queued() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.dirty) > 0 || len(w.evs) > 0
}

func (w *Writer[E, D]) signal() {
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// Run writes until ctx ends, then flushes.
func (w *Writer[E, D]) Run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			w.Flush()
			return
		case <-w.wake:
		}
		for more := true; more; {
			start := time.Now()
			more = w.WriteChunk(w.pace.ChunkRows, true)
			// Rest RestFactor times as long as the chunk took: under
			// a sustained burst the table lags further behind (and
			// catches up after it) instead of taking more than its
			// share of a core from the work it mirrors. With nothing
			// left, rest at least the interval, so that changes
			// coalesce.
			rest := time.Duration(w.pace.RestFactor) * time.Since(start)
			if !more {
				rest = max(w.pace.Interval, rest)
			}
			select {
			case <-ctx.Done():
				w.Flush()
				return
			case <-time.After(rest):
			}
		}
	}
}

// Flush writes the rest of the backlog, then takes what is queued once
// and writes it, without resting. Changes queued while it writes that
// wait for the next flush, so that changes that go on during a stop
// cannot keep it writing.
func (w *Writer[E, D]) Flush() {
	for w.WriteChunk(w.pace.ChunkRows, false) {
	}
	if w.WriteChunk(w.pace.ChunkRows, true) {
		for w.WriteChunk(w.pace.ChunkRows, false) {
		}
	}
}

// WriteChunk writes up to limit rows of the backlog in one transaction;
// when the backlog is empty and take is set, it takes what is queued
// first. It reports whether rows are left in the backlog.
func (w *Writer[E, D]) WriteChunk(limit int, take bool) bool {
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
	// The transaction is opened for the first row: a chunk of objects
	// that came and went before the writer saw them writes nothing.
	var txn statedb.WriteTxn
	n := min(limit, len(w.backlogEvs))
	if n > 0 {
		txn = w.db.WriteTxn(w.table)
	}
	for _, ev := range w.backlogEvs[:n] {
		w.rows.WriteEvent(txn, ev)
	}
	clear(w.backlogEvs[:n])
	w.backlogEvs = w.backlogEvs[n:]
	dirty := w.backlogDirty[w.written:]
	dirty = dirty[:min(w.pace.SkipFactor*limit, len(dirty))]
	rows := n
	for i, d := range dirty {
		if rows == limit {
			dirty = dirty[:i]
			break
		}
		if w.rows.Rowless(d) {
			continue
		}
		if txn == nil {
			txn = w.db.WriteTxn(w.table)
		}
		w.rows.WriteDirty(txn, d)
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
	if !Reusable(cap(w.backlogDirty), len(w.backlogDirty)) {
		w.backlogDirty = nil
	}
	w.backlogDirty, w.written = w.backlogDirty[:0], 0
	return false
}

// takeBacklog moves what is queued to the backlog; the caller holds
// writeMu and has written the previous backlog.
func (w *Writer[E, D]) takeBacklog() {
	// The list goes back for the next burst (its references cleared as
	// they were written, and dropped if too big when it was written).
	done := w.backlogDirty[:0]
	w.mu.Lock()
	w.backlogDirty, w.backlogEvs = w.dirty, w.evs
	w.dirty, w.evs = done, nil
	w.mu.Unlock()
	w.written = 0
}

// maxScratch bounds the capacity of the lists kept for reuse between
// writes (512 KiB of pointers).
const maxScratch = 1 << 16

// Reusable reports whether a scratch list whose last use filled used of
// it is worth keeping: not beyond 65,536 elements, and not when the work
// has shrunk to a quarter of it, so that a quiet writer does not keep a
// burst's lists. The owner's lists of dirty objects follow it too.
func Reusable(capacity, used int) bool {
	return capacity <= maxScratch && 4*used >= capacity
}
