package main

import (
	"errors"
	"net/http"
	"path"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/internal/etcdtest"
)

// TestEtcdOutageLongerThanLeaseTTLProcess runs the agent on an external
// etcd with the shortest lease TTL, and stops etcd for longer than the TTL
// while a global release fails. etcd, back, revives the lease the agent
// took for lost, with the agent's node key and the failed release's
// reference on it: they are the agent's own, not another agent's. Within
// 10s of etcd's return /readyz is 200 again, the label set allocates again
// with its number, and the node key is on the agent's current lease, so
// that it stays when the old lease ends (revoked here, as its expiry
// would); nothing is logged as another agent of the node name.
func TestEtcdOutageLongerThanLeaseTTLProcess(t *testing.T) {
	parallelProcess(t)
	if testing.Short() {
		t.Skip("runs etcd and an agent process for about a minute")
	}
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := etcd.Client(t)
	a := startHealthAgent(t, "--kvstore-endpoints", strings.Join(etcd.Endpoints(), ","), "--node-name", "outage",
		"--kvstore-lease-ttl", kvstore.MinLeaseTTL.String(), "--kvstore-request-timeout", "2s",
		"--identity-allocation-timeout", "5s", "--identity-restore-grace-period", "1s")
	a.waitFor("/readyz", http.StatusOK, 60*time.Second)
	sh := a.dial()
	defer sh.Close()
	lbls := []string{"k8s:app=outage", "k8s:io.kubernetes.pod.namespace=prod"}
	id := allocate(t, sh, lbls...)
	nodeKey := etcdstore.NodeKeyPrefix + "outage"
	resp, err := cli.Get(t.Context(), nodeKey)
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("node key %s before the outage: %v %v", nodeKey, resp, err)
	}
	old := clientv3.LeaseID(resp.Kvs[0].Lease)

	etcd.Member(0).Stop()
	if out, err := sh.Run(time.Now().Add(time.Minute), "identity/release", strconv.Itoa(id)); err == nil {
		t.Fatalf("release succeeded with etcd stopped: %s", out)
	}
	lost := time.Now().Add(kvstore.MinLeaseTTL + time.Minute)
	for !strings.Contains(a.log(), "Lost this node's etcd lease") {
		if time.Now().After(lost) {
			t.Fatal("the agent did not take its lease for lost with etcd stopped past the TTL")
		}
		time.Sleep(200 * time.Millisecond)
	}
	if code, body := a.probe("/readyz"); code != http.StatusServiceUnavailable {
		t.Fatalf("/readyz %d with etcd stopped and the lease lost:\n%s", code, body)
	}
	// Long enough for the first attempts to claim the node name again to
	// fail: etcd stays away for a while.
	time.Sleep(5 * time.Second)
	etcd.Member(0).Restart()
	back := time.Now()
	took, _ := a.waitFor("/readyz", http.StatusOK, 10*time.Second)
	t.Logf("/readyz 200 %s after etcd returned", took.Round(time.Millisecond))
	// A new client: the first one's connection waits out gRPC's pause
	// between attempts, which grows during the outage.
	cfg, err := etcd.ClientConfig()
	if err != nil {
		t.Fatal(err)
	}
	if cli, err = clientv3.New(cfg); err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ref := path.Join(etcdstore.IdentitiesPrefix, "value", "k8s:app=outage;k8s:io.kubernetes.pod.namespace=prod;", "outage")
	if resp, err := cli.Get(t.Context(), ref); err != nil || len(resp.Kvs) != 1 || clientv3.LeaseID(resp.Kvs[0].Lease) != old {
		t.Fatalf("etcd did not revive the old lease %x with the failed release's reference %s (the test shows nothing): %v %v", old, ref, resp, err)
	}
	if again := allocate(t, sh, lbls...); again != id {
		t.Errorf("the released label set came back as %d, want its number %d", again, id)
	}
	// The node key moves to the current lease as soon as etcd answers.
	for {
		resp, err := cli.Get(t.Context(), nodeKey)
		if err == nil && len(resp.Kvs) == 1 && clientv3.LeaseID(resp.Kvs[0].Lease) != old {
			break
		}
		if time.Since(back) > 10*time.Second {
			t.Fatalf("node key %s still on the old lease %x (or gone) 10s after etcd returned: %v %v", nodeKey, old, resp, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("readiness, the label set's number and the node key back %s after etcd returned", time.Since(back).Round(time.Millisecond))

	if _, err := cli.Revoke(t.Context(), old); err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound) {
		t.Fatal(err)
	}
	if resp, err := cli.Get(t.Context(), nodeKey); err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("node key %s gone with the old lease: %v %v", nodeKey, resp, err)
	}
	time.Sleep(time.Second)
	if code, body := a.probe("/readyz"); code != http.StatusOK {
		t.Errorf("/readyz %d after the old lease ended:\n%s", code, body)
	}
	if strings.Contains(a.log(), "Another agent uses this node's name") {
		t.Errorf("the agent took its own keys for another agent's:\n%s", a.log())
	}
}
