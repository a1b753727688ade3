package allocator

import (
	"context"
	"sync"
	"time"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/eventqueue"
	"github.com/identityd/identityd/internal/fanout"
	"github.com/identityd/identityd/internal/idtable"
	"github.com/identityd/identityd/internal/tablewriter"
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
	q     *eventqueue.Queue[event]
	table *tableWriter
}

func newEventQueue(table *tableWriter) *eventQueue {
	return &eventQueue{q: eventqueue.New[event](), table: table}
}

func (q *eventQueue) pushEvent(ev event) { q.q.Push(ev) }

// touch tells the identities table that an entry's count changed.
func (q *eventQueue) touch(e *refEntry) { q.table.touch(e) }

// hold keeps the dispatcher from taking changes until release, so that the
// changes of a batch reach the handlers in one call.
func (q *eventQueue) hold()    { q.q.Hold() }
func (q *eventQueue) release() { q.q.Release() }

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
	state     idtable.Map[identity.Identity]
	observers fanout.Fanout[Change]
	synced    bool
}

func newDispatcher(q *eventQueue, handlers []Handler) *dispatcher {
	return &dispatcher{
		queue:    q,
		handlers: handlers,
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
			d.observers.Close()
			return
		case <-d.queue.q.Wake():
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

// A drain of at least dispatchBurst changes makes the dispatcher pause for
// dispatchBurstPause before the next one.
const (
	dispatchBurst      = 256
	dispatchBurstPause = time.Millisecond
)

// drain delivers everything queued and returns how many changes it took.
// It takes the changes under d.mu, so that whoever holds d.mu never finds
// a change neither queued nor in d.state: a drain that finds the queue
// empty has waited for the drain in progress to deliver.
func (d *dispatcher) drain() int {
	d.mu.Lock()
	chunks := d.queue.q.Take()
	if len(chunks) == 0 {
		d.mu.Unlock()
		return 0
	}
	taken := 0
	for _, c := range chunks {
		taken += len(c)
	}
	// Handler batches and observer events are only built when someone
	// consumes them: a busy allocator queues many changes per drain.
	wantBatch, wantOut := len(d.handlers) > 0, d.observers.Len() > 0
	var added, deleted IdentityMap
	if wantBatch {
		added, deleted = IdentityMap{}, IdentityMap{}
	}
	// The table learns of held entries' changes in one call per drain.
	touched := d.touched[:0]
	var out []Change
	if wantOut {
		out = make([]Change, 0, len(chunks)*eventqueue.ChunkLen)
	}
	for _, ev := range eventqueue.All(chunks) {
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
	d.observers.Publish(out)
	d.queue.table.touchAll(touched)
	clear(touched)
	d.touched = nil
	if tablewriter.Reusable(cap(touched), len(touched)) {
		d.touched = touched[:0]
	}
	d.mu.Unlock()
	d.queue.q.Recycle(chunks)

	if len(added) > 0 || len(deleted) > 0 {
		for _, h := range d.handlers {
			h.UpdateIdentities(added, deleted)
		}
	}
	return taken
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

// Observe implements stream.Observable[Change]. The replay is built under
// the lock under which drain publishes, so it ends where the live changes
// begin.
func (d *dispatcher) Observe(ctx context.Context, next func(Change), complete func(error)) {
	d.mu.Lock()
	defer d.mu.Unlock()
	replay := make([]Change, 0, d.state.Len()+1)
	d.state.Each(func(id *identity.Identity) {
		replay = append(replay, Change{Kind: ChangeUpsert, ID: id.ID, Labels: id.Labels})
	})
	if d.synced {
		replay = append(replay, Change{Kind: ChangeSync})
	}
	d.observers.Subscribe(ctx, replay, next, complete)
}
