package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/cilium/hive/cell"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"

	"github.com/identityd/identityd/internal/retry"
)

// CollectorKeyPrefix is the prefix of the election of the node that runs
// the garbage collection of master keys: every node with a collection
// interval puts one key under it, named by its lease (hex) as etcd's
// concurrency.Election names them, valued with its node name, on its
// lease. The node with the oldest key collects; every other node watches
// only the key just older than its own, so a candidate costs etcd one key
// and one idle watch whatever the number of nodes. Cilium writes no such
// key and reads nothing under it.
const CollectorKeyPrefix = IdentitiesPrefix + "/identityd-gc"

// CollectorJob is the name of the job that campaigns for the collection;
// its health scope says which node collects.
const CollectorJob = "identity-gc-election"

// leadership is this node's term as the collector: it ends when ctx does
// (its lease was lost, or the store stops).
type leadership struct {
	ctx context.Context
	// key and rev are the election key and its create revision: a delete
	// of the collection compares them, so that a term that ended deletes
	// nothing even before this node learns of the end.
	key string
	rev int64
	// lease is the node's lease the key was put on: a key rewritten
	// without it (etcdctl put, which drops the lease) would outlive this
	// node and block every other candidate for good.
	lease clientv3.LeaseID
}

// collector is the election's state.
type collector struct {
	term atomic.Pointer[leadership]
	// holder is the node name of the collector as last seen by this node
	// (this node's own name while it collects).
	holder atomic.Pointer[string]
	// mu orders the election job's health reports, so that a refresh of
	// who collects never reports another node after this one's term began.
	mu sync.Mutex
	// health is the election job's health, which says who collects.
	health cell.Health
}

// candidateMessage is the election's health while node collects and this
// node is a candidate.
func candidateMessage(node string) string {
	return fmt.Sprintf("Node %q collects unused global identities; this node is a candidate", node)
}

// Collecting reports whether this node is the elected collector now.
func (b *Store) Collecting() bool { return b.collector.term.Load() != nil }

// campaignLoop runs the election until ctx ends: it puts this node's key on
// the node's lease, waits until the key is the oldest, and collects from
// then until the lease is lost or the store stops; a lost lease means a new
// key on the next lease, behind the other candidates.
func (b *Store) campaignLoop(ctx context.Context, h cell.Health) {
	b.collector.mu.Lock()
	b.collector.health = h
	b.collector.mu.Unlock()
	failures := 0
	for ctx.Err() == nil {
		err := b.campaignOnce(ctx, h)
		if ctx.Err() != nil {
			return
		}
		if err == nil {
			failures = 0
			continue
		}
		failures++
		// Not a readiness matter: the collection is the cluster's work,
		// not this node's, and an unreachable etcd is reported by the
		// kvstore already. The message says what failed.
		h.OK(fmt.Sprintf("Campaign for the garbage collection of global identities failed, retrying: %v", err))
		// The failed request already waited up to a request timeout;
		// the pause is short so that the node is a candidate again soon
		// after etcd is back.
		retry.Sleep(ctx, retry.Backoff(failures))
	}
}

// campaignOnce is one candidacy on the current lease.
func (b *Store) campaignOnce(ctx context.Context, h cell.Health) error {
	cli := b.kv.Client()
	if cli == nil {
		return errors.New("the kvstore client is stopped")
	}
	lease, err := b.kv.Lease(ctx)
	if err != nil {
		return err
	}
	// The candidacy ends with the lease: its key is gone then.
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(ctx, cancel)()
	lost := b.kv.LeaseLost(lease)
	go func() {
		select {
		case <-lost:
			cancel()
		case <-cctx.Done():
		}
	}()
	// The session shares the node's lease and keepalive; it is never
	// closed (that would revoke the lease), only ended with cctx.
	sess, err := concurrency.NewSession(cli, concurrency.WithLease(lease), concurrency.WithContext(cctx))
	if err != nil {
		return fmt.Errorf("joining the election: %w", err)
	}
	election := concurrency.NewElection(sess, CollectorKeyPrefix)
	b.noteCollector(cctx, election, h)
	key, rev, err := b.campaign(cctx, cli, lease)
	if err != nil {
		if cctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("campaigning: %w", err)
	}
	term := &leadership{ctx: cctx, key: key, rev: rev, lease: lease}
	b.collector.mu.Lock()
	b.collector.term.Store(term)
	b.collector.holder.Store(&b.node)
	h.OK("This node collects unused global identities")
	b.collector.mu.Unlock()
	b.log.Info("This node collects unused global identities", "node", b.node, "key", term.key)
	why := b.holdTerm(cctx, cli, sess, term)
	b.collector.term.Store(nil)
	cancel()
	if ctx.Err() == nil {
		b.log.Warn("This node no longer collects unused global identities", "node", b.node, "reason", why)
	}
	return nil
}

// campaign puts this node's election key on lease, named and valued as
// concurrency.Election.Campaign names and values it, and waits until every
// older key is gone; it returns the key and its create revision. It is
// Campaign without Campaign's clean-up: when ctx ends while it waits,
// Campaign resigns on the client's own context, a delete that nothing
// bounds, so that with etcd gone a stop waited for it until hive's stop
// timeout. Nothing needs deleting then: the stop revokes the lease, or its
// TTL ends it, and a lost lease took the key with it. Each request is
// bounded by the request timeout (and the stop path's deadline).
func (b *Store) campaign(ctx context.Context, cli *clientv3.Client, lease clientv3.LeaseID) (string, int64, error) {
	key := fmt.Sprintf("%s/%x", CollectorKeyPrefix, int64(lease))
	rev, err := b.putCandidacy(ctx, cli, key, lease)
	if err != nil {
		return "", 0, err
	}
	// Wait for the key just older than this node's to go, then look for
	// an older one again, until none is left.
	older := append(clientv3.WithLastCreate(), clientv3.WithMaxCreateRev(rev-1))
	for {
		rctx, cancel := b.requestContext(ctx)
		got, err := cli.Get(rctx, CollectorKeyPrefix+"/", older...)
		cancel()
		if err != nil {
			return "", 0, err
		}
		if len(got.Kvs) == 0 {
			return key, rev, nil
		}
		if err := waitDeleted(ctx, cli, string(got.Kvs[0].Key), got.Header.GetRevision()); err != nil {
			return "", 0, err
		}
	}
}

// putCandidacy puts this node's election key on lease unless it is there
// already, and returns its create revision. A key of that name that is not
// this node's on lease (rewritten by hand: etcdctl put drops the lease) is
// deleted first, with its revision as precondition, and put again: kept,
// it would stay after this node's lease ends and no candidate behind it
// would ever collect.
func (b *Store) putCandidacy(ctx context.Context, cli *clientv3.Client, key string, lease clientv3.LeaseID) (int64, error) {
	for range 3 {
		rctx, cancel := b.requestContext(ctx)
		resp, err := cli.Txn(rctx).
			If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
			Then(clientv3.OpPut(key, b.node, clientv3.WithLease(lease))).
			Else(clientv3.OpGet(key)).
			Commit()
		cancel()
		if err != nil {
			return 0, err
		}
		if resp.Succeeded {
			return resp.Header.GetRevision(), nil
		}
		kvs := resp.Responses[0].GetResponseRange().GetKvs()
		if len(kvs) == 0 {
			continue // deleted meanwhile: put it
		}
		if kvs[0].Lease == int64(lease) && string(kvs[0].Value) == b.node {
			return kvs[0].CreateRevision, nil
		}
		b.log.Warn("This node's collector election key was rewritten; putting it again on the node's lease",
			"key", key, "lease", kvs[0].Lease, "value", string(kvs[0].Value))
		rctx, cancel = b.requestContext(ctx)
		_, err = cli.Txn(rctx).
			If(clientv3.Compare(clientv3.ModRevision(key), "=", kvs[0].ModRevision)).
			Then(clientv3.OpDelete(key)).
			Commit()
		cancel()
		if err != nil {
			return 0, err
		}
	}
	return 0, errors.New("the election key kept changing while it was written")
}

// waitDeleted watches key from revision rev until it is deleted or ctx
// ends.
func waitDeleted(ctx context.Context, cli *clientv3.Client, key string, rev int64) error {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for wr := range cli.Watch(wctx, key, clientv3.WithRev(rev)) {
		if err := wr.Err(); err != nil {
			return err
		}
		for _, ev := range wr.Events {
			if ev.Type == mvccpb.Event_DELETE {
				return nil
			}
		}
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	return errors.New("the watch of the older candidate's key ended")
}

// holdTerm returns when the term ends: the lease was lost, the store
// stops, or the election key went by other means (deleted by hand, say)
// or was rewritten off this node's lease or name, which the collector
// watches, one key, so that two nodes never both believe they collect for
// long. The next campaign puts the key again, behind the other candidates.
func (b *Store) holdTerm(ctx context.Context, cli *clientv3.Client, sess *concurrency.Session, term *leadership) string {
	wch := cli.Watch(ctx, term.key, clientv3.WithRev(term.rev+1))
	for {
		select {
		case <-ctx.Done():
			return "its lease ended"
		case <-sess.Done():
			return "its lease ended"
		case wr, ok := <-wch:
			if !ok || wr.Canceled {
				if ctx.Err() != nil {
					return "its lease ended"
				}
				// The watch broke (compaction, say): look again.
				wch = cli.Watch(ctx, term.key, clientv3.WithRev(term.rev+1))
				if !b.keyHolds(ctx, cli, term) {
					return "its election key is gone"
				}
				continue
			}
			for _, ev := range wr.Events {
				if ev.Type == mvccpb.Event_DELETE {
					return "its election key was deleted"
				}
				if ev.Kv.Lease != int64(term.lease) || string(ev.Kv.Value) != b.node {
					return "its election key was rewritten"
				}
			}
		}
	}
}

// keyHolds reads whether the term's election key is still the one it
// created; an unanswered read counts as holding (the deletes' compare
// guards the collection meanwhile).
func (b *Store) keyHolds(ctx context.Context, cli *clientv3.Client, term *leadership) bool {
	rctx, cancel := b.requestContext(ctx)
	defer cancel()
	resp, err := cli.Get(rctx, term.key, clientv3.WithKeysOnly())
	if err != nil {
		return true
	}
	return len(resp.Kvs) == 1 && resp.Kvs[0].CreateRevision == term.rev && resp.Kvs[0].Lease == int64(term.lease)
}

// noteCollector reads who collects now (one request) and reports it.
func (b *Store) noteCollector(ctx context.Context, election *concurrency.Election, h cell.Health) {
	rctx, cancel := b.requestContext(ctx)
	defer cancel()
	resp, err := election.Leader(rctx)
	switch {
	case errors.Is(err, concurrency.ErrElectionNoLeader):
		h.OK("Campaigning to collect unused global identities; no node collects yet")
	case err != nil:
		h.OK("Campaigning to collect unused global identities")
	default:
		name := string(resp.Kvs[0].Value)
		b.collector.holder.Store(&name)
		h.OK(candidateMessage(name))
	}
}

// refreshCollector updates who collects as seen from a node that does
// not, once per collection interval: one request that returns one key.
// The election's health says the same as Collector from then on.
func (b *Store) refreshCollector(ctx context.Context, cli *clientv3.Client) {
	rctx, cancel := b.requestContext(ctx)
	defer cancel()
	resp, err := cli.Get(rctx, CollectorKeyPrefix+"/", clientv3.WithFirstCreate()...)
	if err != nil || len(resp.Kvs) == 0 {
		return
	}
	name := string(resp.Kvs[0].Value)
	b.collector.mu.Lock()
	defer b.collector.mu.Unlock()
	if b.collector.term.Load() != nil {
		return // this node's term began meanwhile
	}
	if prev := b.collector.holder.Swap(&name); (prev == nil || *prev != name) && b.collector.health != nil {
		b.collector.health.OK(candidateMessage(name))
	}
}

// withdrawCandidacy deletes the election key the gone agent of this node
// name left on its lease (a SIGKILL revokes nothing): until that lease
// expired, up to --kvstore-lease-ttl later, a dead agent whose key is the
// oldest would stay the collector, and no live node would collect or, in
// the double-write modes, report convergence. The key is named by the
// lease as concurrency.Election names it; the delete happens only while it
// still holds this node's name on that lease, so a key of any other agent
// is never touched. A failure is logged: the key then goes with the lease.
func (b *Store) withdrawCandidacy(ctx context.Context, cli *clientv3.Client, lease int64) {
	if lease == 0 {
		return
	}
	key := fmt.Sprintf("%s/%x", CollectorKeyPrefix, lease)
	rctx, cancel := b.requestContext(ctx)
	defer cancel()
	resp, err := cli.Txn(rctx).
		If(clientv3.Compare(clientv3.Value(key), "=", b.node),
			clientv3.Compare(clientv3.LeaseValue(key), "=", clientv3.LeaseID(lease))).
		Then(clientv3.OpDelete(key)).
		Commit()
	switch {
	case err != nil:
		b.log.Warn("Could not withdraw the collector candidacy of the gone agent of this node name; it ends with its lease",
			"node", b.node, "key", key, "error", err)
	case resp.Succeeded:
		b.log.Info("Withdrew the collector candidacy of the gone agent of this node name", "node", b.node, "key", key)
	}
}
