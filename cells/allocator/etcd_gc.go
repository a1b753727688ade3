package allocator

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/identity"
)

// GCStats counts the work of the garbage collection of master keys since
// the backend was created.
type GCStats struct {
	// Runs and Failed count collections, and those that ended in an error.
	Runs, Failed uint64
	// Deleted counts master keys deleted; Skipped counts unreferenced
	// candidates whose delete transaction found them referenced or changed.
	Deleted, Skipped uint64
}

type gcCounters struct {
	runs, failed, deleted, skipped atomic.Uint64
}

// GCStats returns the garbage collection's counters, for metrics.
func (b *EtcdBackend) GCStats() GCStats {
	return GCStats{
		Runs:    b.gc.runs.Load(),
		Failed:  b.gc.failed.Load(),
		Deleted: b.gc.deleted.Load(),
		Skipped: b.gc.skipped.Load(),
	}
}

func (b *EtcdBackend) gcLoop(ctx context.Context) {
	select {
	case <-b.synced:
	case <-ctx.Done():
		return
	}
	t := time.NewTicker(b.cfg.IdentityGCInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-b.kv.Stopping():
			// No collection while the agent stops: it would only
			// compete with the stop for its short etcd deadline.
			return
		case <-t.C:
		}
		deleted, skipped, err := b.RunGC(ctx)
		if err != nil {
			if ctx.Err() == nil {
				b.log.Warn("Garbage collection of global identities failed", "error", err, "deleted", deleted)
			}
			continue
		}
		if deleted > 0 || skipped > 0 {
			b.log.Info("Garbage collection of global identities", "deleted", deleted, "skipped", skipped)
		}
	}
}

// RunGC deletes master keys that no node references. Candidates come from
// the cache and one listing of reference keys; each is deleted by a
// transaction that proves at that instant that no reference key and no
// Cilium lock exists for its label set and that the master key has not
// changed since it was cached. A node that allocates the label set at the
// same time either makes the compare fail or sees the key gone, so unlike
// a mark-and-sweep the collection needs no second pass. Deletions are paced
// by --identity-gc-rate-limit per --identity-gc-rate-interval.
func (b *EtcdBackend) RunGC(ctx context.Context) (deleted, skipped int, err error) {
	b.gc.runs.Add(1)
	defer func() {
		if err != nil {
			b.gc.failed.Add(1)
		}
	}()
	if !b.Synced() {
		return 0, 0, fmt.Errorf("%w: global identities are not listed yet", ErrKVStoreUnavailable)
	}
	cli := b.kv.Client()
	if cli == nil {
		return 0, 0, fmt.Errorf("%w: the kvstore client is stopped", ErrKVStoreUnavailable)
	}
	referenced, listRev, err := b.referencedLabelSets(ctx, cli)
	if err != nil {
		return 0, 0, err
	}

	type candidate struct {
		id     identity.NumericIdentity
		key    string
		modRev int64
	}
	var candidates []candidate
	b.cacheMu.RLock()
	for id, e := range b.byID {
		if _, ok := referenced[referenceBase(e.key)]; !ok {
			candidates = append(candidates, candidate{id, e.key, e.modRev})
		}
	}
	b.cacheMu.RUnlock()

	for _, c := range candidates {
		if err := b.gcLimiter.Wait(ctx); err != nil {
			return deleted, skipped, err
		}
		master := masterKey(c.id)
		rctx, cancel := b.requestContext(ctx)
		// The listing at listRev found no reference of the label set
		// under its prefix, though maybe keys of label sets that extend
		// it (see outForeign); comparing that nothing under the prefix
		// was written since then proves the same now.
		refs := referencePrefix(c.key)
		resp, err := cli.Txn(rctx).If(
			clientv3.Compare(clientv3.ModRevision(master), "=", c.modRev),
			clientv3.Compare(clientv3.ModRevision(refs), "<", listRev+1).WithRange(clientv3.GetPrefixRangeEnd(refs)),
			clientv3.Compare(clientv3.CreateRevision(lockPrefix(c.key)), "=", 0).WithPrefix(),
		).Then(clientv3.OpDelete(master)).Commit()
		cancel()
		if err != nil {
			return deleted, skipped, fmt.Errorf("%w: deleting master key %s: %w", ErrKVStoreUnavailable, master, err)
		}
		if resp.Succeeded {
			deleted++
			b.gc.deleted.Add(1)
		} else {
			skipped++
			b.gc.skipped.Add(1)
		}
	}
	return deleted, skipped, nil
}

// referencedLabelSets lists the reference keys (keys only, page by page,
// all at one revision, which it returns) and returns the reference bases (see referenceBase) that have at least
// one: a label string cleaned as Cilium cleans it, which the master key's
// value need not be.
func (b *EtcdBackend) referencedLabelSets(ctx context.Context, cli *clientv3.Client) (map[string]struct{}, int64, error) {
	out := map[string]struct{}{}
	end := clientv3.GetPrefixRangeEnd(ReferenceKeyPrefix)
	from, rev := ReferenceKeyPrefix, int64(0)
	for {
		opts := []clientv3.OpOption{clientv3.WithRange(end), clientv3.WithLimit(listPageSize), clientv3.WithKeysOnly()}
		if rev != 0 {
			opts = append(opts, clientv3.WithRev(rev))
		}
		rctx, cancel := b.requestContext(ctx)
		resp, err := cli.Get(rctx, from, opts...)
		cancel()
		if err != nil {
			return nil, 0, fmt.Errorf("%w: listing reference keys: %w", ErrKVStoreUnavailable, err)
		}
		if rev == 0 {
			rev = resp.Header.Revision
		}
		for _, kv := range resp.Kvs {
			// The node name follows the last "/"; label strings
			// may hold "/" themselves.
			key := string(kv.Key)
			if i := strings.LastIndexByte(key, '/'); i >= len(ReferenceKeyPrefix) {
				out[key[:i]] = struct{}{}
			}
		}
		if !resp.More || len(resp.Kvs) == 0 {
			return out, rev, nil
		}
		from = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
}
