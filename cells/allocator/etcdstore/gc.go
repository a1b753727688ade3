package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/identity"
)

type gcCounters struct {
	runs, failed, deleted, skipped atomic.Uint64
	// afterListing, when set (by tests), runs between the listing of
	// reference keys and the choice of candidates.
	afterListing func()
}

// collection is the store's side of the collection job: no collection
// before the first listing, nor while the agent stops (it would only
// compete with the stop for its short etcd deadline); while another node
// collects, a tick notes which, for health and the shell.
func (b *Store) collection() globalstore.Collection {
	return globalstore.Collection{
		What: "global identities",
		Ready: func() bool {
			select {
			case <-b.kv.Stopping():
				return false
			default:
				return b.Synced()
			}
		},
		Term: func() context.Context {
			if term := b.collector.term.Load(); term != nil {
				return term.ctx
			}
			return nil
		},
		Idle: func(ctx context.Context) {
			if cli := b.kv.Client(); cli != nil {
				b.refreshCollector(ctx, cli)
			}
		},
		Pass: func(ctx context.Context) (globalstore.GCResult, error) {
			term := b.collector.term.Load()
			if term == nil {
				return globalstore.GCResult{}, nil
			}
			return b.runGC(ctx, term)
		},
	}
}

// errNotCollector: a delete of the collection found that this node's term
// as the elected collector had ended.
var errNotCollector = errors.New("this node is no longer the elected collector")

// runGC deletes master keys that no node references. Candidates come from
// the cache and one listing of reference keys, less the master keys written
// after that listing; each is deleted by a
// transaction that proves at that instant that no reference key and no
// Cilium lock exists for its label set and that the master key has not
// changed since it was cached. A node that allocates the label set at the
// same time either makes the compare fail or sees the key gone, so unlike
// a mark-and-sweep the collection needs no second pass. Deletions are paced
// by --identity-gc-rate-limit per --identity-gc-rate-interval. With a term,
// each delete also proves that the term lasts, so that a collector whose
// lease ended deletes nothing more.
func (b *Store) runGC(ctx context.Context, term *leadership) (res globalstore.GCResult, err error) {
	b.gc.runs.Add(1)
	defer func() {
		if err != nil {
			b.gc.failed.Add(1)
		}
	}()
	if !b.Synced() {
		return res, fmt.Errorf("%w: global identities are not listed yet", globalstore.ErrUnavailable)
	}
	cli := b.kv.Client()
	if cli == nil {
		return res, fmt.Errorf("%w: the kvstore client is stopped", globalstore.ErrUnavailable)
	}
	referenced, listRev, err := b.referencedLabelSets(ctx, cli)
	if err != nil {
		return res, err
	}

	type candidate struct {
		id     identity.NumericIdentity
		key    string
		modRev int64
	}
	if b.gc.afterListing != nil {
		b.gc.afterListing()
	}
	var candidates []candidate
	b.cacheMu.RLock()
	for id, e := range b.byID {
		if e.modRev > listRev {
			// Written after the listing, which cannot show its
			// references (a new identity's reference is written in
			// its master key's transaction): its delete would fail
			// and spend a deletion of the rate limit for nothing.
			// The next run decides.
			continue
		}
		if _, ok := referenced[referenceBase(e.key)]; !ok {
			candidates = append(candidates, candidate{id, e.key, e.modRev})
		}
	}
	b.cacheMu.RUnlock()

	for _, c := range candidates {
		if err := b.gcLimiter.Wait(ctx); err != nil {
			return res, err
		}
		master := masterKey(c.id)
		rctx, cancel := b.requestContext(ctx)
		// The listing at listRev found no reference of the label set
		// under its prefix, though maybe keys of label sets that extend
		// it (see outForeign); comparing that nothing under the prefix
		// was written since then proves the same now.
		refs := referencePrefix(c.key)
		cmps := []clientv3.Cmp{
			clientv3.Compare(clientv3.ModRevision(master), "=", c.modRev),
			clientv3.Compare(clientv3.ModRevision(refs), "<", listRev+1).WithRange(clientv3.GetPrefixRangeEnd(refs)),
			clientv3.Compare(clientv3.CreateRevision(lockPrefix(c.key)), "=", 0).WithPrefix(),
		}
		var orElse []clientv3.Op
		if term != nil {
			cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(term.key), "=", term.rev))
			orElse = append(orElse, clientv3.OpGet(term.key, clientv3.WithKeysOnly()))
		}
		resp, err := cli.Txn(rctx).If(cmps...).Then(clientv3.OpDelete(master)).Else(orElse...).Commit()
		cancel()
		if err != nil {
			return res, fmt.Errorf("%w: deleting master key %s: %w", globalstore.ErrUnavailable, master, err)
		}
		if !resp.Succeeded && term != nil && !termHolds(resp, term) {
			return res, errNotCollector
		}
		if resp.Succeeded {
			res.Deleted++
			b.gc.deleted.Add(1)
		} else {
			res.Skipped++
			b.gc.skipped.Add(1)
		}
	}
	return res, nil
}

// termHolds reports whether the Else of a failed delete found the term's
// election key as the term created it.
func termHolds(resp *clientv3.TxnResponse, term *leadership) bool {
	if len(resp.Responses) == 0 {
		return false
	}
	kvs := resp.Responses[0].GetResponseRange().GetKvs()
	return len(kvs) == 1 && kvs[0].CreateRevision == term.rev
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
