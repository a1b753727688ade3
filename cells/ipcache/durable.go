package ipcache

import (
	"context"
	"errors"
	"fmt"
	"net/netip"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/durability"
	"github.com/identityd/identityd/internal/ipcachemap"
)

// WaitDurable returns once the prefixes' pairs, as the table has them when
// it is called, survive a crash of the agent (SIGKILL included): this is
// the durability point of Upsert, UpsertBatch and Remove, which return
// before it. For each prefix,
//
//   - its row is written to the datapath map (the reconciler's status is
//     Done), or its removal has been processed; with the file backend the
//     map file is written afterwards (a pinned bpf map lives in the kernel);
//   - its identity, when it is a node-local or remote-node identity the
//     ipcache allocated, is in a checkpoint on disk, when the hive has the
//     checkpoint cell (allocator.LocalIdentitySyncer).
//
// The map and the checkpoint are waited for at once, and concurrent callers
// share the file and checkpoint writes. It fails at once, wrapping
// ErrNotWritten, for a prefix whose map write failed (the reconciler keeps
// retrying it), and with ctx's error when ctx ends first, even while a
// write of the map file or the checkpoint hangs on a stalled disk (that
// write goes on and lands once the disk answers); either way the upsert
// itself stays applied. Prefixes that are not valid are ignored, as
// the upsert refused them. The reconciler writes nothing before restoration
// has finished (Allocator.WaitForRestoration), so a start hook must not
// wait for WaitDurable: restoration's start hook may come after it.
func (c *IPCache) WaitDurable(ctx context.Context, prefixes ...netip.Prefix) error {
	if len(prefixes) == 0 {
		return nil
	}
	keys := make([]netip.Prefix, 0, len(prefixes))
	for _, p := range prefixes {
		if k, err := normalize(p); err == nil {
			keys = append(keys, k)
		}
	}

	// The checkpoint write runs while the reconciler writes the map: the
	// identities are allocated already, and the two waits add up to the
	// longer of them, not to their sum.
	var cpDone chan error
	if c.localSync != nil {
		if held := c.heldLocal(c.db.ReadTxn(), keys); len(held) > 0 {
			cpDone = make(chan error, 1)
			if s, ok := c.localSync.(allocator.IdentitySyncer); ok {
				// One journal record per new identity, none for one
				// already durable.
				go func() { cpDone <- s.SyncIdentities(ctx, held...) }()
			} else {
				go func() { cpDone <- c.localSync.Sync(ctx) }()
			}
		}
	}
	err := c.waitMapDurable(ctx, keys)
	if cpDone != nil {
		if cpErr := <-cpDone; cpErr != nil {
			err = errors.Join(err, fmt.Errorf("local identities not in the checkpoint: %w", cpErr))
		}
	}
	return err
}

// drain waits, on stop, until the reconciler has processed every change of
// the table, so that a clean stop keeps every pair, answered with waiting
// or not: the map is written (and its file, on close) after.
func (c *IPCache) drain(ctx cell.HookContext) error {
	// The hive stops once every start hook that will run has run: if
	// restoration has not finished, it never will (the start failed
	// before it), and the reconciler, which waits for it, has written
	// nothing and must not: the map keeps its old entries. Otherwise
	// ready is closed, or about to be by the waitForRestoration job,
	// which stops after this hook.
	ended, cancel := context.WithCancel(ctx)
	cancel()
	if c.alloc.WaitForRestoration(ended) != nil {
		return nil
	}
	select {
	case <-c.ready:
	case <-ctx.Done():
		return fmt.Errorf("ipcache rows not written to the datapath map before stop: %w", ctx.Err())
	}
	rev := c.table.Revision(c.db.ReadTxn())
	if _, _, err := c.rec.WaitUntilReconciled(ctx, rev); err != nil {
		return fmt.Errorf("ipcache rows not all written to the datapath map before stop: %w", err)
	}
	return nil
}

// heldLocal returns the local identities the rows of the prefixes hold.
func (c *IPCache) heldLocal(txn statedb.ReadTxn, keys []netip.Prefix) []*identity.Identity {
	var out []*identity.Identity
	for _, k := range keys {
		if e, _, ok := c.table.Get(txn, PrefixIndex.Query(k)); ok && e.held != nil && e.Identity.HasLocalScope() {
			out = append(out, e.held)
		}
	}
	return out
}

// waitMapDurable waits until the rows of keys are written to the map, then
// makes the map durable.
func (c *IPCache) waitMapDurable(ctx context.Context, keys []netip.Prefix) error {
	txn := c.db.ReadTxn()
	if c.allWritten(txn, keys) {
		// Every row is in the map as it is: only its durability is left,
		// which costs no write when nothing changed.
		return c.syncMap(ctx, keys)
	}
	rev := c.table.Revision(txn)
	var failed []error
	for {
		// The reconciler's progress, not a watch per row: one wait for a
		// batch of any size.
		if _, _, err := c.rec.WaitUntilReconciled(ctx, rev); err != nil {
			return fmt.Errorf("waiting for the datapath map: %w", err)
		}
		txn := c.db.ReadTxn()
		var later statedb.Revision
		failed = failed[:0]
		for _, k := range keys {
			e, r, ok := c.table.Get(txn, PrefixIndex.Query(k))
			if !ok {
				// Removed: the reconciler has processed the removal.
				continue
			}
			switch e.Status.Kind {
			case reconciler.StatusKindDone:
			case reconciler.StatusKindError:
				failed = append(failed, fmt.Errorf("%s: %w (the write is retried): %s", k, ErrNotWritten, e.Status.GetError()))
			default:
				// Changed again since: wait for the newer row.
				later = max(later, r)
			}
		}
		if later == 0 {
			break
		}
		// A row left pending at a revision already waited for is only
		// possible if its status is still on its way: wait for the next.
		rev = max(later, rev+1)
	}
	// The rows that were written are made durable even when others
	// failed.
	err := c.syncMap(ctx, keys)
	return errors.Join(append(failed, err)...)
}

// allWritten tells whether every prefix has a row the reconciler has
// written to the map as it is now.
func (c *IPCache) allWritten(txn statedb.ReadTxn, keys []netip.Prefix) bool {
	for _, k := range keys {
		e, _, ok := c.table.Get(txn, PrefixIndex.Query(k))
		if !ok || e.Status.Kind != reconciler.StatusKindDone {
			return false
		}
	}
	return true
}

// syncMap makes what the map holds for keys durable, or gives up waiting
// when ctx ends.
func (c *IPCache) syncMap(ctx context.Context, keys []netip.Prefix) error {
	m, err := c.mapOrErr()
	if err != nil {
		return err
	}
	if m.Kind() != ipcachemap.KindFile {
		// The kernel holds a bpf map: written is durable.
		return nil
	}
	// SyncKeys writes the journal's records only if one of the keys
	// changed since they were last made durable, and concurrent callers
	// share one write (group commit). A write on a stalled disk cannot be
	// interrupted, but the wait for it can: the caller's bound holds, and
	// the write goes on.
	mk := make([]ipcachemap.Key, len(keys))
	for i, k := range keys {
		mk[i] = ipcachemap.Key{Prefix: k}
	}
	if err := durability.Wait(ctx, func() error { return m.SyncKeys(mk) }); err != nil {
		return fmt.Errorf("write the ipcache map file: %w", err)
	}
	return nil
}
