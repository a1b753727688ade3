package etcdstore

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/eventually"
	"github.com/identityd/identityd/labels"
)

// TestEtcdOutageLongerThanLeaseTTL stops etcd for longer than the node's
// lease TTL while a release fails. The client takes the lease for lost,
// but etcd, once back, gives its leases a full TTL anew: the node's key,
// its candidacy and the reference of the failed release are still there,
// on the old lease. They are this agent's own, not another agent's: the
// node key moves to the current lease, held references too, the released
// label set allocates again with its number, and nothing is reported as a
// second agent of the node name. Once the old lease ends (revoked here, as
// its expiry would), the node key and the references are all still there.
func TestEtcdOutageLongerThanLeaseTTL(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	n := startEtcdNode(t, c, "node1", func(kv *kvstore.Config, e *storeConfig) {
		kv.KVStoreLeaseTTL = kvstore.MinLeaseTTL
		kv.KVStoreRequestTimeout = time.Second
		// A candidate, so that there is a candidacy to move; no
		// periodic sync, so that the repair is the lease loss's.
		e.IdentityGCInterval = time.Hour
		e.KVStorePeriodicSync = 0
	})
	prov := health.NewProvider()
	n.backend.health = prov.Root().NewScope("node-name")
	ctx := testCtx(t, 3*time.Minute)
	released := labels.MustParse("k8s:app=released", "k8s:io.kubernetes.pod.namespace=prod")
	held := labels.MustParse("k8s:app=held", "k8s:io.kubernetes.pod.namespace=prod")
	rid, _, err := n.alloc.Allocate(ctx, released)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := n.alloc.Allocate(ctx, held); err != nil {
		t.Fatal(err)
	}
	cli := c.Client(t)
	_, old, ok := getValue(t, cli, NodeKeyPrefix+"node1")
	if !ok || old == 0 {
		t.Fatalf("node key missing before the outage (lease %x)", old)
	}
	eventually.Within(t, 30*time.Second, "candidacy on the node's lease", func() bool {
		_, l, ok := getValue(t, cli, CollectorKeyPrefix+"/"+leaseHex(old))
		return ok && l == old
	})

	c.Member(0).Stop()
	if _, err := n.alloc.Release(ctx, rid); err == nil {
		t.Fatal("release succeeded with etcd stopped")
	}
	select {
	case <-n.kv.LeaseLost(clientv3.LeaseID(old)):
	case <-time.After(kvstore.MinLeaseTTL + time.Minute):
		t.Fatal("the client did not take its lease for lost with etcd stopped past the TTL")
	}
	c.Member(0).Restart()
	// A new client: the first one's connection waits out gRPC's pause
	// between attempts, which grew during the outage.
	cli = c.Client(t)
	if _, l, ok := getValue(t, cli, refKey(released, "node1")); !ok || l != old {
		t.Fatalf("etcd did not revive the old lease with the failed release's reference (lease %x, present %v): the test shows nothing", l, ok)
	}

	back := time.Now()
	eventually.Within(t, 10*time.Second, "node key and held reference on the current lease", func() bool {
		cur, err := n.kv.Lease(ctx)
		if err != nil || int64(cur) == old {
			return false
		}
		_, nl, ok := getValue(t, cli, NodeKeyPrefix+"node1")
		_, rl, rok := getValue(t, cli, refKey(held, "node1"))
		return ok && rok && nl == int64(cur) && rl == int64(cur)
	})
	again, _, err := n.alloc.Allocate(ctx, released)
	if err != nil {
		t.Fatalf("allocating the released label set after etcd came back: %v", err)
	}
	if again.ID != rid.ID {
		t.Errorf("released label set came back as %d, want its number %d", again.ID, rid.ID)
	}
	t.Logf("node key, references and the released label set back %s after etcd returned", time.Since(back).Round(time.Millisecond))
	if _, l, _ := getValue(t, cli, CollectorKeyPrefix+"/"+leaseHex(old)); l == old {
		t.Error("the candidacy on the old lease is still there")
	}
	if s := n.backend.nodeCheckStats(); s.NameConflicts != 0 {
		t.Errorf("%d node-name conflicts reported for this agent's own keys", s.NameConflicts)
	}
	if ok, why := prov.Healthy(); !ok {
		t.Errorf("node-name health after etcd came back: %v", why)
	}

	// The old lease ends, as its TTL would end it.
	if _, err := cli.Revoke(ctx, clientv3.LeaseID(old)); err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound) {
		t.Fatal(err)
	}
	for _, key := range []string{NodeKeyPrefix + "node1", refKey(held, "node1"), refKey(released, "node1")} {
		if _, _, ok := getValue(t, cli, key); !ok {
			t.Errorf("%s gone with the old lease", key)
		}
	}
	if _, err := n.backend.syncReferences(ctx); err != nil {
		t.Fatal(err)
	}
	if s := n.backend.nodeCheckStats(); s.NameConflicts != 0 || s.ReferencesRewritten != 0 {
		t.Errorf("after the old lease ended: %+v, want no conflict and nothing to rewrite", s)
	}
}

func leaseHex(lease int64) string { return fmt.Sprintf("%x", lease) }

// TestEtcdSyncMovesNodeKey: a periodic sync that finds this agent's node
// key (its own claim) on a lease other than its current one writes it on
// the current lease: the other lease's end would take the key with it.
func TestEtcdSyncMovesNodeKey(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	n := startEtcdNode(t, c, "node1", func(_ *kvstore.Config, e *storeConfig) { e.KVStorePeriodicSync = 0 })
	ctx := testCtx(t, time.Minute)
	cli := c.Client(t)
	claim, cur, ok := getValue(t, cli, NodeKeyPrefix+"node1")
	if !ok {
		t.Fatal("no node key")
	}
	other, err := cli.Grant(ctx, 600)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, NodeKeyPrefix+"node1", claim, clientv3.WithLease(other.ID)); err != nil {
		t.Fatal(err)
	}
	if _, err := n.backend.syncReferences(ctx); err != nil {
		t.Fatal(err)
	}
	v, l, ok := getValue(t, cli, NodeKeyPrefix+"node1")
	if !ok || v != claim || l != cur {
		t.Fatalf("node key after the sync: %q on lease %x (present %v), want %q on the current lease %x", v, l, ok, claim, cur)
	}
	if _, err := cli.Revoke(ctx, other.ID); err != nil {
		t.Fatal(err)
	}
	if _, _, ok := getValue(t, cli, NodeKeyPrefix+"node1"); !ok {
		t.Fatal("node key gone with the other lease")
	}
	if s := n.backend.nodeCheckStats(); s.NameConflicts != 0 {
		t.Errorf("%d node-name conflicts for this agent's own key", s.NameConflicts)
	}
}
