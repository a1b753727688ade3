package etcdstore

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/eventually"
	"github.com/identityd/identityd/labels"
)

// TestEtcdCollectorElection: of two nodes with a GC interval, exactly one
// collects. When its term ends under it (its election key deleted), it
// stops collecting, a delete of the ended term deletes nothing, and the
// other node collects; a clean stop hands the collection over at once.
func TestEtcdCollectorElection(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	withGC := func(_ *kvstore.Config, e *storeConfig) {
		// Campaigns, but the timer's runs are the test's own.
		e.IdentityGCInterval = time.Hour
		e.IdentityGCRateLimit = 1_000_000
	}
	n1 := startEtcdNode(t, c, "node1", withGC)
	n2 := startEtcdNode(t, c, "node2", withGC)
	nodes := []*etcdNode{n1, n2}
	collecting := func() []*etcdNode {
		var out []*etcdNode
		for _, n := range nodes {
			if n.backend.Collecting() {
				out = append(out, n)
			}
		}
		return out
	}
	eventually.True(t, "one node collects", func() bool { return len(collecting()) == 1 })
	leader := collecting()[0]
	other := n1
	if leader == n1 {
		other = n2
	}
	ctx := testCtx(t, time.Minute)
	other.backend.refreshCollector(ctx, cli)
	if name, ok := other.backend.collectorSeen(); !ok || name != leader.name {
		t.Errorf("%s sees %q (%v) collecting, want %s", other.name, name, ok, leader.name)
	}

	// An unreferenced master key, in the caches.
	orphan := identity.NumericIdentity(60000)
	if _, err := cli.Put(ctx, masterKey(orphan), labels.MustParse("k8s:app=orphan").Canonical()); err != nil {
		t.Fatal(err)
	}
	eventually.True(t, "caches hold the orphan", func() bool {
		_, ok1 := leader.backend.LookupByID(orphan)
		_, ok2 := other.backend.LookupByID(orphan)
		return ok1 && ok2
	})

	term := leader.backend.collector.term.Load()
	if term == nil {
		t.Fatal("no term")
	}
	if _, err := cli.Delete(ctx, term.key); err != nil {
		t.Fatal(err)
	}
	eventually.True(t, "the other node collects alone", func() bool {
		c := collecting()
		return len(c) == 1 && c[0] == other
	})
	if _, err := leader.backend.runGC(ctx, term); !errors.Is(err, errNotCollector) {
		t.Errorf("a run of the ended term: %v, want %v", err, errNotCollector)
	}
	if _, _, ok := getValue(t, cli, masterKey(orphan)); !ok {
		t.Fatal("a run of the ended term deleted the orphan")
	}
	res, err := other.backend.runGC(ctx, other.backend.collector.term.Load())
	if err != nil || res.Deleted != 1 {
		t.Errorf("the new collector's run: deleted %d, %v; want 1", res.Deleted, err)
	}

	// A clean stop revokes the lease and with it the election key.
	stopped := time.Now()
	other.stop()
	nodes = []*etcdNode{leader}
	eventually.True(t, "the remaining node collects", func() bool { return leader.backend.Collecting() })
	if took := time.Since(stopped); took > 10*time.Second {
		t.Errorf("handover after a clean stop took %s", took)
	}
}

// TestEtcdCollectorKilledAndRestarted: the collector killed with SIGKILL
// leaves its election key on its lease, the oldest key; when it comes back
// under its node name it takes the name over from its gone process and
// withdraws that key too, so that a live node collects at once instead of
// a lease TTL later (in the double-write modes nobody would report
// convergence meanwhile). The key of a gone agent of another node name
// stays: only its lease ends it.
func TestEtcdCollectorKilledAndRestarted(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	ctx := testCtx(t, time.Minute)
	host, _ := os.Hostname()
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	// What the killed agents left: node key and election key on a lease
	// that outlives the test.
	killed := func(node string) string {
		t.Helper()
		lease, err := cli.Grant(ctx, 3600)
		if err != nil {
			t.Fatal(err)
		}
		claim, _ := json.Marshal(globalstore.NodeClaim{Instance: "dead-" + node, Host: host, PID: gone.Process.Pid})
		key := fmt.Sprintf("%s/%x", CollectorKeyPrefix, lease.ID)
		if _, err := cli.Txn(ctx).Then(
			clientv3.OpPut(NodeKeyPrefix+node, string(claim), clientv3.WithLease(lease.ID)),
			clientv3.OpPut(key, node, clientv3.WithLease(lease.ID)),
		).Commit(); err != nil {
			t.Fatal(err)
		}
		return key
	}
	killedKey := killed("restarted")
	withGC := func(_ *kvstore.Config, e *storeConfig) { e.IdentityGCInterval = time.Hour }
	other := startEtcdNode(t, c, "other", withGC)
	// The other node campaigns in a job of its own: its key must be in
	// before the gone agent of another name leaves its key, so that the
	// other node's is the oldest once the restarted node withdraws its
	// gone process's. (Written after it, the gone agent's key is the
	// oldest, and no node collects for as long as its lease lasts.)
	eventually.True(t, "the other node campaigns", func() bool {
		resp, err := cli.Get(ctx, CollectorKeyPrefix+"/", clientv3.WithPrefix())
		if err != nil {
			return false
		}
		for _, kv := range resp.Kvs {
			if string(kv.Value) == "other" {
				return true
			}
		}
		return false
	})
	otherKilledKey := killed("elsewhere")
	if other.backend.Collecting() {
		t.Fatal("a node collects while the killed collector's key is the oldest")
	}

	restarted := startEtcdNode(t, c, "restarted", withGC)
	eventually.True(t, "a live node collects after the killed collector's restart", func() bool {
		return other.backend.Collecting() || restarted.backend.Collecting()
	})
	if restarted.backend.Collecting() {
		t.Error("the restarted node collects, though the other node's key is older than its new one")
	}
	if _, _, ok := getValue(t, cli, killedKey); ok {
		t.Errorf("the killed agent's election key %s is still there", killedKey)
	}
	if v, _, ok := getValue(t, cli, otherKilledKey); !ok || v != "elsewhere" {
		t.Errorf("the election key of the gone agent of another node name: %q %v, want it kept", v, ok)
	}
}

// TestEtcdCollectorKeysDeletedOrRewritten: under three running nodes, the
// election's keys are deleted by hand (etcdctl del --prefix), then the
// collector's key is rewritten off its lease (etcdctl put, which drops the
// lease) and the collector stopped. Each time one node collects again
// within one lease TTL, and its runs delete an unreferenced master key.
// Before, the rewritten key stayed the oldest after its node was gone, and
// no candidate behind it ever collected.
func TestEtcdCollectorKeysDeletedOrRewritten(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	withGC := func(kv *kvstore.Config, e *storeConfig) {
		kv.KVStoreLeaseTTL = kvstore.MinLeaseTTL
		e.IdentityGCInterval = 100 * time.Millisecond
		e.IdentityGCRateLimit = 1_000_000
	}
	nodes := []*etcdNode{startEtcdNode(t, c, "node1", withGC), startEtcdNode(t, c, "node2", withGC), startEtcdNode(t, c, "node3", withGC)}
	ctx := testCtx(t, 2*time.Minute)
	// collects waits until exactly one of nodes collects and its runs
	// delete an unreferenced master key written now, within one lease
	// TTL from since.
	orphans := identity.NumericIdentity(60000)
	collects := func(what string, since time.Time) *etcdNode {
		t.Helper()
		orphans++
		orphan := orphans
		if _, err := cli.Put(ctx, masterKey(orphan), labels.MustParse(fmt.Sprintf("k8s:app=orphan-%d", orphan)).Canonical()); err != nil {
			t.Fatal(err)
		}
		var leader *etcdNode
		eventually.Within(t, kvstore.MinLeaseTTL, what+": one node collects and deletes an unreferenced master key", func() bool {
			leader = nil
			for _, n := range nodes {
				if n.backend.Collecting() {
					if leader != nil {
						return false
					}
					leader = n
				}
			}
			_, _, kept := getValue(t, cli, masterKey(orphan))
			return leader != nil && !kept
		})
		t.Logf("%s: %s collects, and deleted an unreferenced master key %s later", what, leader.name, time.Since(since).Round(10*time.Millisecond))
		return leader
	}
	collects("start", time.Now())

	deleted := time.Now()
	if _, err := cli.Delete(ctx, CollectorKeyPrefix+"/", clientv3.WithPrefix()); err != nil {
		t.Fatal(err)
	}
	leader := collects("election keys deleted", deleted)
	eventually.True(t, "every candidate has its key again", func() bool {
		resp, err := cli.Get(ctx, CollectorKeyPrefix+"/", clientv3.WithPrefix())
		return err == nil && len(resp.Kvs) == len(nodes)
	})

	term := leader.backend.collector.term.Load()
	if term == nil {
		t.Fatal("the collector has no term")
	}
	rewritten := time.Now()
	if _, err := cli.Put(ctx, term.key, leader.name); err != nil {
		t.Fatal(err)
	}
	// The rewritten collector hands over, or takes its key back on its
	// lease: in both cases a clean stop of the collector then ends its
	// key, and another node collects.
	leader = collects("election key rewritten off its lease", rewritten)
	stopped := time.Now()
	leader.stop()
	nodes = slices.DeleteFunc(nodes, func(n *etcdNode) bool { return n == leader })
	collects("collector stopped", stopped)
	resp, err := cli.Get(ctx, CollectorKeyPrefix+"/", clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	for _, kv := range resp.Kvs {
		if kv.Lease == 0 {
			t.Errorf("election key %s is on no lease", kv.Key)
		}
	}
}
