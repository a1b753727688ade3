package etcdstore

import (
	"context"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/identity"
)

// What the tests read of a store's state, which nothing in production
// asks for.

// nodeCheckStats counts what the checks of this node's keys found since the
// backend was created.
type nodeCheckStats struct {
	// NameConflicts counts checks that found this node's name used by
	// another writer: another agent's node key, or a reference key of
	// this node's name on a lease that is not this node's.
	NameConflicts uint64
	// ReferencesRewritten counts reference keys of this node that were
	// missing or changed and were written again.
	ReferencesRewritten uint64
	// SplitLabelSets counts references this node did not write again
	// because other nodes reference the label set under another ID.
	SplitLabelSets uint64
	// TakenIdentities counts checks that found the master key of a
	// global identity this node uses holding another label set.
	TakenIdentities uint64
}

// nodeCheckStats returns the counters of the node key and reference checks.
func (b *Store) nodeCheckStats() nodeCheckStats {
	return nodeCheckStats{
		NameConflicts:       b.nodeStats.conflicts.Load(),
		ReferencesRewritten: b.nodeStats.rewritten.Load(),
		SplitLabelSets:      b.nodeStats.splits.Load(),
		TakenIdentities:     b.nodeStats.taken.Load(),
	}
}

// collectorSeen returns the node name of the collector as this node last saw
// it, and whether one was seen. It asks etcd nothing.
func (b *Store) collectorSeen() (string, bool) {
	if p := b.collector.holder.Load(); p != nil {
		return *p, true
	}
	return "", false
}

// heldLabelSets returns the label sets this node references in etcd, by
// canonical string, as the allocator records them.
func (b *Store) heldLabelSets() map[string]identity.NumericIdentity {
	refs := b.heldRefs()
	out := make(map[string]identity.NumericIdentity, len(refs))
	for _, r := range refs {
		out[r.Labels.Canonical()] = r.ID
	}
	return out
}

// gcStats counts the work of the garbage collection of master keys since
// the backend was created.
type gcStats struct {
	// Runs and Failed count collections, and those that ended in an error.
	Runs, Failed uint64
	// Deleted counts master keys deleted; Skipped counts unreferenced
	// candidates whose delete transaction found them referenced or changed.
	Deleted, Skipped uint64
}

func (b *Store) gcStats() gcStats {
	return gcStats{
		Runs:    b.gc.runs.Load(),
		Failed:  b.gc.failed.Load(),
		Deleted: b.gc.deleted.Load(),
		Skipped: b.gc.skipped.Load(),
	}
}

// collect is one collection outside the election, as if this node held
// the collector's lock.
func (b *Store) collect(ctx context.Context) (globalstore.GCResult, error) {
	return b.runGC(ctx, nil)
}
