package crdstore

// What the tests read of a store's state, which nothing in production
// asks for: production reads the same counters through the store's
// metrics.

// gcStats counts the collector's work since the store was created.
type gcStats struct {
	Runs, Failed                       uint64
	Marked, Deleted, Skipped, Unmarked uint64
	NodesDeleted                       uint64
	LastKeptUsed, LastKeptFenced       uint64
	// Reclaimed counts the identities this node's walks deleted to take
	// their slots in a range without a free one.
	Reclaimed uint64
}

func (s *Store) gcStats() gcStats {
	gc := s.gc
	return gcStats{
		Runs: gc.runs.Load(), Failed: gc.failed.Load(),
		Marked: gc.marked.Load(), Deleted: gc.deleted.Load(), Skipped: gc.skipped.Load(), Unmarked: gc.unmarked.Load(),
		NodesDeleted: gc.nodesDeleted.Load(), Reclaimed: gc.reclaimed.Load(),
		LastKeptUsed: gc.keptUsed.Load(), LastKeptFenced: gc.keptFenced.Load(),
	}
}
