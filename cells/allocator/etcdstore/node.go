package etcdstore

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"

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
var ErrNodeNameInUse = errors.New("node name is in use by another live agent")

// nodeClaim is the value of a node key.
type nodeClaim struct {
	Instance string `json:"instance"`
	Host     string `json:"host"`
	PID      int    `json:"pid"`
}

func (c nodeClaim) String() string {
	return fmt.Sprintf("host %q, pid %d, instance %s", c.Host, c.PID, c.Instance)
}

// liveInstances holds the instances of the backends of this process that
// claimed their node name: a claim with this process's host and PID that
// is not among them was left by a hive of this process that is gone,
// while one that is among them belongs to another hive that runs beside.
var liveInstances sync.Map

func newNodeClaim() nodeClaim {
	var b [8]byte
	_, _ = rand.Read(b[:])
	host, _ := os.Hostname()
	return nodeClaim{Instance: hex.EncodeToString(b[:]), Host: host, PID: os.Getpid()}
}

// NodeStats counts what the checks of this node's keys found since the
// backend was created.
type NodeStats struct {
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
}

type nodeCounters struct {
	conflicts, rewritten, splits atomic.Uint64
}

// NodeStats returns the counters of the node key and reference checks.
func (b *Store) NodeStats() NodeStats {
	return NodeStats{
		NameConflicts:       b.nodeStats.conflicts.Load(),
		ReferencesRewritten: b.nodeStats.rewritten.Load(),
		SplitLabelSets:      b.nodeStats.splits.Load(),
	}
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
			liveInstances.Store(b.claim.Instance, struct{}{})
			return nil
		}
		kvs := resp.Responses[0].GetResponseRange().GetKvs()
		if len(kvs) == 0 {
			continue // deleted meanwhile
		}
		var other nodeClaim
		if err := json.Unmarshal(kvs[0].Value, &other); err != nil || other.Instance == "" {
			return fmt.Errorf("%w: --node-name %q: %s holds %q, which is not an identityd node key", ErrNodeNameInUse, b.node, key, kvs[0].Value)
		}
		if other.Instance != b.claim.Instance && !b.claimIsStale(other) {
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
			if other.Instance != b.claim.Instance {
				b.log.Info("Took over the node name from an agent that is gone", "node", b.node, "previous", other.String())
			}
			liveInstances.Store(b.claim.Instance, struct{}{})
			return nil
		}
	}
	return fmt.Errorf("%w: claiming node name %q: the key kept changing", globalstore.ErrConflict, b.node)
}

// claimIsStale reports whether the agent that wrote other is certainly
// gone: it ran on this host and its process has ended, or it was a hive
// of this process that is no longer running.
func (b *Store) claimIsStale(other nodeClaim) bool {
	if other.Host != b.claim.Host {
		return false
	}
	if other.PID == b.claim.PID {
		_, live := liveInstances.Load(other.Instance)
		return !live
	}
	return !processAlive(other.PID)
}

// processAlive reports whether pid names a running process of this host. A
// zombie (killed, not yet reaped by its parent) is not running: its agent
// holds nothing any more.
func processAlive(pid int) bool {
	if pid <= 0 || errors.Is(syscall.Kill(pid, 0), syscall.ESRCH) {
		return false
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return !errors.Is(err, os.ErrNotExist)
	}
	// The state follows the command name, which is in parentheses and
	// may hold anything, so look after the last ")".
	if i := bytes.LastIndexByte(stat, ')'); i >= 0 && i+2 < len(stat) {
		return stat[i+2] != 'Z' && stat[i+2] != 'X'
	}
	return true
}

// releaseNodeName forgets this backend's claim in the process; the key
// itself goes with the lease.
func (b *Store) releaseNodeName() {
	liveInstances.Delete(b.claim.Instance)
}

// checkNodeName reads this node's key during the periodic sync: a missing
// key (the lease was lost) is claimed again, another agent's is a conflict.
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
	var other nodeClaim
	if json.Unmarshal(resp.Kvs[0].Value, &other) != nil || other.Instance != b.claim.Instance {
		b.nameConflict(fmt.Errorf("%w: node key %s holds %q", ErrNodeNameInUse, key, resp.Kvs[0].Value))
	}
	return nil
}

// nameConflict reports a second writer of this node's name.
func (b *Store) nameConflict(err error) {
	b.nodeStats.conflicts.Add(1)
	b.conflictSeen.Store(true)
	b.log.Error("Another agent uses this node's name in etcd; each agent needs its own --node-name", "node", b.node, "error", err)
	if b.health != nil {
		// Not ready, but not dead: restarting this agent would not
		// stop the other writer.
		b.health.Degraded("Another agent uses this node's name in etcd", health.External(err))
	}
}
