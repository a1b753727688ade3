package allocator

import (
	"strconv"
	"time"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/tablewriter"
)

// TableName is the name of the identities table.
const TableName = "identities"

// EntryIDIndex finds an identity by its numeric ID (primary index).
var EntryIDIndex = statedb.Index[Entry, identity.NumericIdentity]{
	Name: "id",
	FromObject: func(e Entry) index.KeySet {
		return index.NewKeySet(index.Uint32(uint32(e.Identity.ID)))
	},
	FromKey: func(id identity.NumericIdentity) index.Key { return index.Uint32(uint32(id)) },
	FromString: func(s string) (index.Key, error) {
		id, err := identity.ParseNumericIdentity(s)
		return index.Uint32(uint32(id)), err
	},
	Unique: true,
}

// EntryLabelsIndex finds an identity by the canonical string of its labels.
var EntryLabelsIndex = statedb.Index[Entry, string]{
	Name: "labels",
	FromObject: func(e Entry) index.KeySet {
		return index.NewKeySet(index.Key(e.Identity.Labels.CanonicalBytes()))
	},
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// NewTable creates the identities table; the allocator cell provides it
// read-only as statedb.Table[Entry].
func NewTable(db *statedb.DB) (statedb.RWTable[Entry], error) {
	return statedb.NewTable(db, TableName, EntryIDIndex, EntryLabelsIndex)
}

// TableHeader implements statedb.TableWritable.
func (Entry) TableHeader() []string {
	return []string{"ID", "Labels", "Scope", "RefCount", "Source"}
}

// TableRow implements statedb.TableWritable.
func (e Entry) TableRow() []string {
	return []string{
		e.Identity.ID.String(),
		e.Identity.Labels.String(),
		scopeName(e.Identity.ID),
		strconv.Itoa(e.RefCount),
		string(e.Source),
	}
}

func scopeName(id identity.NumericIdentity) string {
	if id.IsReserved() {
		return "reserved"
	}
	return id.Scope().String()
}

// tableWriterInterval is the least time between two writes of the
// identities table. The table is for operators and other cells to read;
// coalescing keeps a busy allocator from spending a core on it: an entry
// that changes many times between two writes is written once.
const tableWriterInterval = 10 * time.Millisecond

// tableWriterRestFactor bounds the table writer's share of a core to
// 1/(1+tableWriterRestFactor): under a sustained burst the table lags
// further behind (and catches up after it) instead of taking more than a
// quarter of a core from the allocations it mirrors. A row costs about a
// microsecond of statedb writes, several times an allocation.
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
	*tablewriter.Writer[event, *refEntry]
	table statedb.RWTable[Entry]
	// known reports whether an identity still exists, for global
	// identities this node stopped holding.
	known func(identity.NumericIdentity) bool
}

func newTableWriter(db *statedb.DB, table statedb.RWTable[Entry]) *tableWriter {
	w := &tableWriter{table: table}
	w.Writer = tablewriter.New(db, statedb.TableMeta(table), w, tablewriter.Pace{
		Interval:   tableWriterInterval,
		ChunkRows:  tableWriterChunk,
		SkipFactor: tableWriterSkipFactor,
		RestFactor: tableWriterRestFactor,
	})
	return w
}

func (w *tableWriter) touch(e *refEntry) {
	if w.table == nil || !e.markDirty() {
		return
	}
	w.AddDirty(e)
}

// touchAll is touch for the entries of a dispatcher drain, with one lock.
func (w *tableWriter) touchAll(es []*refEntry) {
	if w.table == nil || len(es) == 0 {
		return
	}
	w.AddDirtyFunc(es, (*refEntry).markDirty)
}

func (w *tableWriter) apply(ev event) {
	if w.table == nil {
		return
	}
	w.AddEvent(ev)
}

// WriteEvent implements tablewriter.Rows.
func (w *tableWriter) WriteEvent(txn statedb.WriteTxn, ev event) {
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

// Rowless implements tablewriter.Rows. It reports whether e needs no
// write: a local entry released before any row was written from it. Under
// churn most entries are, and each would otherwise cost a lookup in a
// write transaction, which kept the writer so far behind that released
// entries piled up in its backlog. A released entry is never taken again,
// so the answer cannot change.
func (w *tableWriter) Rowless(e *refEntry) bool {
	f := e.flags.Load()
	if f&(entryGlobal|entryInTable) != 0 || e.refs.Load() > 0 {
		return false
	}
	e.flags.And(^entryDirty)
	return true
}

// WriteDirty implements tablewriter.Rows.
func (w *tableWriter) WriteDirty(txn statedb.WriteTxn, e *refEntry) {
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
