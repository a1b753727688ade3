package etcdstore

import (
	"context"
	"encoding/json"
	"fmt"
	"sync/atomic"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/health"
)

// NodeKeyPrefix precedes a node name: the key names the agent that uses
// the name, and lives on that agent's lease. Reference keys end in the node
// name, so two live agents with one name would delete each other's
// references; the key lets the second refuse to start. Cilium writes no
// such key and reads nothing under it.
const NodeKeyPrefix = IdentitiesPrefix + "/identityd-nodes/"

// ErrNodeNameInUse: another live agent uses this node name on the etcd.
var ErrNodeNameInUse = globalstore.ErrNodeNameInUse

type nodeCounters struct {
	conflicts, rewritten, splits, taken atomic.Uint64
}

// claimNodeName writes this node's key on its lease unless another live
// agent holds it. A key left by an agent that is gone (same host, its
// process ended, as after a SIGKILL and restart) is taken over.
func (b *Store) claimNodeName(ctx context.Context) error {
	cli := b.kv.Client()
	if cli == nil {
		return globalstore.ErrUnavailable
	}
	lease, err := b.kv.Lease(ctx)
	if err != nil {
		return fmt.Errorf("%w: %w", globalstore.ErrUnavailable, err)
	}
	b.noteLease(lease)
	key := NodeKeyPrefix + b.node
	value, _ := json.Marshal(b.claim)
	for range 4 {
		rctx, cancel := b.requestContext(ctx)
		resp, err := cli.Txn(rctx).
			If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
			Then(clientv3.OpPut(key, string(value), clientv3.WithLease(lease))).
			Else(clientv3.OpGet(key)).
			Commit()
		cancel()
		if err != nil {
			return fmt.Errorf("%w: claiming node name %q: %w", globalstore.ErrUnavailable, b.node, err)
		}
		if resp.Succeeded {
			b.claim.Hold()
			return nil
		}
		kvs := resp.Responses[0].GetResponseRange().GetKvs()
		if len(kvs) == 0 {
			continue // deleted meanwhile
		}
		var other globalstore.NodeClaim
		if err := json.Unmarshal(kvs[0].Value, &other); err != nil || other.Instance == "" {
			return fmt.Errorf("%w: --node-name %q: %s holds %q, which is not an identityd node key", ErrNodeNameInUse, b.node, key, kvs[0].Value)
		}
		if other.Instance != b.claim.Instance && !b.claim.Gone(other) {
			return fmt.Errorf("%w: --node-name %q is used by the agent of %s (key %s, on lease %x); give each agent its own node name",
				ErrNodeNameInUse, b.node, other, key, kvs[0].Lease)
		}
		rctx, cancel = b.requestContext(ctx)
		take, err := cli.Txn(rctx).
			If(clientv3.Compare(clientv3.ModRevision(key), "=", kvs[0].ModRevision)).
			Then(clientv3.OpPut(key, string(value), clientv3.WithLease(lease))).
			Commit()
		cancel()
		if err != nil {
			return fmt.Errorf("%w: claiming node name %q: %w", globalstore.ErrUnavailable, b.node, err)
		}
		if take.Succeeded {
			// The gone agent's reference keys are this node's now.
			b.predecessorLease.Store(kvs[0].Lease)
			switch {
			case other.Instance != b.claim.Instance:
				b.log.Info("Took over the node name from an agent that is gone", "node", b.node, "previous", other.String())
				b.withdrawCandidacy(ctx, cli, kvs[0].Lease)
			case kvs[0].Lease != int64(lease):
				// This agent's own key on a lease it took for lost
				// while etcd was away, which etcd revived when it came
				// back: the key would vanish when that lease expires,
				// and its candidacy there would hold up the election
				// as long.
				b.log.Info("Moved this node's key to its current lease", "node", b.node,
					"from", fmt.Sprintf("%x", kvs[0].Lease), "to", fmt.Sprintf("%x", int64(lease)))
				b.withdrawCandidacy(ctx, cli, kvs[0].Lease)
			}
			b.claim.Hold()
			return nil
		}
	}
	return fmt.Errorf("%w: claiming node name %q: the key kept changing", globalstore.ErrConflict, b.node)
}

// releaseNodeName forgets this backend's claim in the process; the key
// itself goes with the lease.
func (b *Store) releaseNodeName() {
	b.claim.Forget()
}

// checkNodeName reads this node's key during the periodic sync: a missing
// key (the lease was lost), or this agent's key on a lease it no longer
// keeps alive, is claimed again; another agent's is a conflict.
func (b *Store) checkNodeName(ctx context.Context, cli *clientv3.Client) error {
	key := NodeKeyPrefix + b.node
	rctx, cancel := b.requestContext(ctx)
	resp, err := cli.Get(rctx, key)
	cancel()
	if err != nil {
		return fmt.Errorf("%w: reading node key %s: %w", globalstore.ErrUnavailable, key, err)
	}
	if len(resp.Kvs) == 0 {
		return b.claimNodeName(ctx)
	}
	var other globalstore.NodeClaim
	if json.Unmarshal(resp.Kvs[0].Value, &other) != nil || other.Instance != b.claim.Instance {
		b.nameConflict(fmt.Errorf("%w: node key %s holds %q", ErrNodeNameInUse, key, resp.Kvs[0].Value))
		return nil
	}
	// This agent's key on an earlier lease of its own goes when that
	// lease expires: claimed again on the current one.
	if lease, err := b.kv.Lease(ctx); err == nil && int64(lease) != resp.Kvs[0].Lease {
		return b.claimNodeName(ctx)
	}
	return nil
}

// nameConflict reports a second writer of this node's name.
func (b *Store) nameConflict(err error) {
	b.conflict(&b.nodeStats.conflicts, "Another agent uses this node's name in etcd",
		"each agent needs its own --node-name", err)
}

// conflict reports what another writer did to this node's keys that this
// node cannot undo: it is counted in count, logged as an error (what, then
// advice), and turns the node-name health scope degraded until a check of
// the node's keys finds no conflict. The cause is external: not ready, but
// not dead, since restarting this agent would not undo it.
func (b *Store) conflict(count *atomic.Uint64, what, advice string, err error) {
	count.Add(1)
	b.conflictSeen.Store(true)
	b.log.Error(what+"; "+advice, "node", b.node, "error", err)
	if b.health != nil {
		b.health.Degraded(what, health.External(err))
	}
}
