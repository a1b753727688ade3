package etcdstore

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/cilium/hive/job"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/health"
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
func (b *Store) GCStats() GCStats {
	return GCStats{
		Runs:    b.gc.runs.Load(),
		Failed:  b.gc.failed.Load(),
		Deleted: b.gc.deleted.Load(),
		Skipped: b.gc.skipped.Load(),
	}
}

func (b *Store) gcTick(life context.Context) job.TimerFunc {
	return func(ctx context.Context) error {
		ctx, cancel := lifeOf(ctx, life)
		defer cancel()
		select {
		case <-b.synced:
		default:
			// Nothing to collect from before the first listing.
			return nil
		}
		select {
		case <-b.kv.Stopping():
			// No collection while the agent stops: it would only
			// compete with the stop for its short etcd deadline.
			return nil
		default:
		}
		deleted, skipped, err := b.RunGC(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			// etcd's doing, not the agent's: readiness, not liveness.
			return health.External(fmt.Errorf("garbage collection of global identities failed after %d deletions: %w", deleted, err))
		}
		if deleted > 0 || skipped > 0 {
			b.log.Info("Garbage collection of global identities", "deleted", deleted, "skipped", skipped)
		}
		return nil
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
func (b *Store) RunGC(ctx context.Context) (deleted, skipped int, err error) {
	b.gc.runs.Add(1)
	defer func() {
		if err != nil {
			b.gc.failed.Add(1)
		}
	}()
	if !b.Synced() {
		return 0, 0, fmt.Errorf("%w: global identities are not listed yet", globalstore.ErrUnavailable)
	}
	cli := b.kv.Client()
	if cli == nil {
		return 0, 0, fmt.Errorf("%w: the kvstore client is stopped", globalstore.ErrUnavailable)
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
			return deleted, skipped, fmt.Errorf("%w: deleting master key %s: %w", globalstore.ErrUnavailable, master, err)
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
func (b *Store) referencedLabelSets(ctx context.Context, cli *clientv3.Client) (map[string]struct{}, int64, error) {
	out := map[string]struct{}{}
	rev, err := listPrefix(ctx, cli, ReferenceKeyPrefix, b.requestContext, func(kv *mvccpb.KeyValue) {
		// The node name follows the last "/"; label strings may hold
		// "/" themselves.
		key := string(kv.Key)
		if i := strings.LastIndexByte(key, '/'); i >= len(ReferenceKeyPrefix) {
			out[key[:i]] = struct{}{}
		}
	}, clientv3.WithKeysOnly())
	if err != nil {
		return nil, 0, fmt.Errorf("%w: listing reference keys: %w", globalstore.ErrUnavailable, err)
	}
	return out, rev, nil
}
