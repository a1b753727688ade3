package ipcache

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	healthpkg "github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/internal/ipcachemap"
)

// Tuning of the reconciler.
const (
	// pruneInterval is how often the map is compared with the whole table
	// once the table is initialized: entries the table does not have are
	// deleted and entries with another value are rewritten. It replaces
	// the reconciler's per-object refresh, which would rewrite every row
	// of a million-prefix table.
	pruneInterval = 10 * time.Minute
	// roundSize and roundsPerSecond trade latency for batch size: a round
	// writes at most roundSize rows in one map batch and commits their
	// statuses in one transaction.
	roundSize       = 10000
	roundsPerSecond = 50
	// syncInterval is the shortest time between two writes of the map
	// file's journal for changes nobody waits for.
	syncInterval = 200 * time.Millisecond
	// compactInterval is the shortest time between two writes of the
	// whole map file (a million entries are 36 MB), the snapshot after
	// which its journal is emptied; a journal larger than
	// journalSizeFactor times the file (and than minCompactSize) is
	// compacted sooner, so the cost of the rewrite stays spread over the
	// changes that made it grow.
	compactInterval   = 10 * time.Second
	journalSizeFactor = 4
	minCompactSize    = 16 << 20
)

// ops writes ipcache rows into the datapath map. Every operation is
// idempotent: the reconciler retries failures with backoff.
type ops struct{ c *IPCache }

var (
	_ reconciler.Operations[*Entry]      = ops{}
	_ reconciler.BatchOperations[*Entry] = ops{}
)

func mapKey(e *Entry) ipcachemap.Key { return ipcachemap.Key{Prefix: e.Prefix} }

func mapValue(e *Entry) ipcachemap.Value {
	return ipcachemap.Value{Identity: e.Identity, TunnelEndpoint: e.TunnelEndpoint, EncryptKey: e.EncryptKey}
}

// Update implements reconciler.Operations.
func (o ops) Update(ctx context.Context, _ statedb.ReadTxn, _ statedb.Revision, e *Entry) error {
	m, err := o.c.waitReady(ctx)
	if err != nil {
		return err
	}
	defer o.c.triggerSync()
	return externalCause(m.Update(mapKey(e), mapValue(e)))
}

// externalCause marks the map's errors that a restart of the agent would
// not mend, a full map or a full or read-only file system, as external, so
// that the reconciler's health makes the agent not ready but still live.
func externalCause(err error) error {
	if errors.Is(err, ipcachemap.ErrFull) {
		return healthpkg.External(err)
	}
	return healthpkg.ExternalIO(err)
}

// Delete implements reconciler.Operations.
func (o ops) Delete(ctx context.Context, _ statedb.ReadTxn, _ statedb.Revision, e *Entry) error {
	m, err := o.c.waitReady(ctx)
	if err != nil {
		return err
	}
	defer o.c.triggerSync()
	return m.Delete(mapKey(e))
}

// UpdateBatch implements reconciler.BatchOperations. The map's batch write
// stops at the first error, so after a failure each entry is written alone
// to find which ones fail.
func (o ops) UpdateBatch(ctx context.Context, _ statedb.ReadTxn, batch []reconciler.BatchEntry[*Entry]) {
	m, err := o.c.waitReady(ctx)
	if err != nil {
		failBatch(batch, err)
		return
	}
	defer o.c.triggerSync()
	entries := make([]ipcachemap.Entry, len(batch))
	for i, b := range batch {
		entries[i] = ipcachemap.Entry{Key: mapKey(b.Object), Value: mapValue(b.Object)}
	}
	if m.UpdateBatch(entries) == nil {
		return
	}
	for i := range batch {
		batch[i].Result = externalCause(m.Update(entries[i].Key, entries[i].Value))
	}
}

// DeleteBatch implements reconciler.BatchOperations.
func (o ops) DeleteBatch(ctx context.Context, _ statedb.ReadTxn, batch []reconciler.BatchEntry[*Entry]) {
	m, err := o.c.waitReady(ctx)
	if err != nil {
		failBatch(batch, err)
		return
	}
	defer o.c.triggerSync()
	keys := make([]ipcachemap.Key, len(batch))
	for i, b := range batch {
		keys[i] = mapKey(b.Object)
	}
	if m.DeleteBatch(keys) == nil {
		return
	}
	for i := range batch {
		batch[i].Result = m.Delete(keys[i])
	}
}

// failBatch gives every entry of batch the result err.
func failBatch(batch []reconciler.BatchEntry[*Entry], err error) {
	for i := range batch {
		batch[i].Result = err
	}
}

// Prune implements reconciler.Operations. The reconciler calls it only
// once the table is initialized: before, an entry missing from the table
// may be one that restoration has yet to re-create. Entries are checked
// against the table's primary index rather than a set built from the
// iterator, which would double the memory of a large table.
func (o ops) Prune(ctx context.Context, txn statedb.ReadTxn, _ iter.Seq2[*Entry, statedb.Revision]) error {
	m, err := o.c.waitReady(ctx)
	if err != nil {
		return err
	}
	var (
		stale []ipcachemap.Key
		fix   []ipcachemap.Entry
	)
	err = m.Dump(func(k ipcachemap.Key, v ipcachemap.Value) bool {
		e, _, found := o.c.table.Get(txn, PrefixIndex.Query(k.Prefix))
		switch {
		case !found || k.ClusterID != 0:
			stale = append(stale, k)
		case e.Status.Kind == reconciler.StatusKindDone && mapValue(e) != v:
			// Someone else changed the entry; rows not yet reconciled
			// are left to the incremental path.
			fix = append(fix, ipcachemap.Entry{Key: k, Value: mapValue(e)})
		}
		return ctx.Err() == nil
	})
	if err != nil {
		return fmt.Errorf("dump ipcache map: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	var errs []error
	if len(stale) > 0 {
		if err := m.DeleteBatch(stale); err != nil {
			errs = append(errs, fmt.Errorf("delete %d stale entries: %w", len(stale), err))
		}
	}
	if len(fix) > 0 {
		if err := m.UpdateBatch(fix); err != nil {
			errs = append(errs, fmt.Errorf("rewrite %d changed entries: %w", len(fix), err))
		}
	}
	if len(stale)+len(fix) > 0 {
		o.c.log.Info("IPCache map pruned", "deleted", len(stale), "rewritten", len(fix))
		o.c.triggerSync()
	}
	return errors.Join(errs...)
}

func (c *IPCache) triggerSync() {
	select {
	case c.syncNow <- struct{}{}:
	default:
	}
}

// syncLoop persists the map (file backend) after writes: the journal's
// new records at most once per syncInterval, the whole file at most once
// per compactInterval (or when the journal has grown large), and retries
// failed writes. It runs as a job so that its failures show in the
// module's health.
func (c *IPCache) syncLoop(ctx context.Context, health cell.Health) error {
	backoff := syncInterval
	compact := time.NewTicker(compactInterval)
	defer compact.Stop()
	for {
		whole := false
		select {
		case <-ctx.Done():
			return nil
		case <-c.syncNow:
		case <-compact.C:
			whole = true
		}
		m, err := c.waitReady(ctx)
		if err != nil {
			return nil
		}
		if m.Kind() != ipcachemap.KindFile {
			// The kernel holds a bpf map: nothing to persist.
			continue
		}
		if !whole {
			size := ipcachemap.JournalSize(m)
			whole = size > minCompactSize && size > journalSizeFactor*ipcachemap.FileSize(m)
		}
		if whole {
			err = m.Compact()
		} else {
			err = m.Sync()
		}
		if err != nil {
			// A full or read-only file system: not ready, still live.
			health.Degraded("ipcache map file write failed", healthpkg.ExternalIO(err))
			c.triggerSync()
			// At most a few seconds: the write succeeds again as soon as
			// space is freed, and readiness follows it.
			backoff = min(backoff*2, 5*time.Second)
		} else {
			health.OK("ipcache map file written")
			backoff = syncInterval
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(backoff):
		}
	}
}
