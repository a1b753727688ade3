package kvstore_test

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/testhive"
)

// node is one agent's hive running the kvstore cell.
type node struct {
	t       testing.TB
	h       *hive.Hive
	client  *kvstore.Client
	running *testhive.Running
}

func newNode(t testing.TB, stateDir string, configure func(*kvstore.Config)) *node {
	n := &node{t: t}
	n.h = hive.New(
		statedir.Cell,
		kvstore.Cell,
		cell.Invoke(func(c *kvstore.Client) { n.client = c }),
	)
	hive.AddConfigOverride(n.h, func(c *statedir.Config) { c.StateDir = stateDir })
	hive.AddConfigOverride(n.h, func(c *kvstore.Config) {
		c.NodeName = "test-node"
		c.KVStoreDialTimeout = 5 * time.Second
		if configure != nil {
			configure(c)
		}
	})
	return n
}

func (n *node) start() error {
	r, err := testhive.TryStart(n.t, n.h, nil)
	if err == nil {
		n.running = r
	}
	return err
}

func (n *node) stop() {
	if n.running != nil {
		n.running.Stop()
	}
}

// startNode starts a node against the cluster (nil: embedded etcd).
func startNode(t testing.TB, c *etcdtest.Cluster, configure func(*kvstore.Config)) *node {
	t.Helper()
	n := newNode(t, t.TempDir(), func(cfg *kvstore.Config) {
		if c != nil {
			cfg.KVStoreEndpoints = c.Endpoints()
		}
		if configure != nil {
			configure(cfg)
		}
	})
	if err := n.start(); err != nil {
		t.Fatalf("start: %v", err)
	}
	return n
}

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func mustGet(t testing.TB, cli *clientv3.Client, key string) (string, bool) {
	t.Helper()
	resp, err := cli.Get(ctxT(t), key)
	if err != nil {
		t.Fatalf("get %s: %v", key, err)
	}
	if len(resp.Kvs) == 0 {
		return "", false
	}
	return string(resp.Kvs[0].Value), true
}

func TestEmbeddedPersistsAcrossRestart(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	n := newNode(t, dir, nil)
	if err := n.start(); err != nil {
		t.Fatal(err)
	}
	c := n.client
	if !c.Embedded() {
		t.Fatal("not embedded")
	}
	eps := c.Endpoints()
	if len(eps) != 1 || !strings.HasPrefix(eps[0], "https://127.0.0.1:") || strings.HasSuffix(eps[0], ":0") {
		t.Fatalf("embedded endpoint %v, want an ephemeral loopback port", eps)
	}
	if _, err := c.Client().Put(ctxT(t), "persist", "yes"); err != nil {
		t.Fatal(err)
	}
	st := c.Status(ctxT(t))
	if st.Mode() != "embedded" || st.Connected() != 1 || st.Leader != eps[0] {
		t.Fatalf("status: %+v", st)
	}
	n.stop()
	if c.Client() != nil {
		t.Fatal("client still set after stop")
	}
	if fi, err := os.Stat(filepath.Join(dir, "etcd", "member")); err != nil || !fi.IsDir() {
		t.Fatalf("no etcd data in state dir: %v", err)
	}

	n2 := newNode(t, dir, nil)
	if err := n2.start(); err != nil {
		t.Fatal(err)
	}
	if v, ok := mustGet(t, n2.client.Client(), "persist"); !ok || v != "yes" {
		t.Fatalf("after restart got %q, %v", v, ok)
	}
}

func TestExternal(t *testing.T) {
	t.Parallel()
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	n := startNode(t, etcd, nil)
	c := n.client
	if c.Embedded() || c.NodeName() != "test-node" {
		t.Fatalf("embedded %v, node %q", c.Embedded(), c.NodeName())
	}
	if _, err := c.Client().Put(ctxT(t), "k", "v"); err != nil {
		t.Fatal(err)
	}
	if v, _ := mustGet(t, etcd.Client(t), "k"); v != "v" {
		t.Fatalf("got %q", v)
	}
	st := c.Status(ctxT(t))
	if st.Mode() != "external" || st.Connected() != 1 || st.Leader != etcd.Endpoints()[0] || st.Revision < 2 {
		t.Fatalf("status: %+v", st)
	}
	out := kvstore.FormatStatus(st)
	for _, want := range []string{"Mode        external", "Connected   1/1", "Lease       none", etcd.Endpoints()[0]} {
		if !strings.Contains(out, want) {
			t.Errorf("status output lacks %q:\n%s", want, out)
		}
	}
}

func TestTLS(t *testing.T) {
	t.Parallel()
	etcd := etcdtest.StartSingle(t, etcdtest.WithTLS(nil), etcdtest.WithUnsafeNoFsync())
	certs := etcd.Certs()
	n := startNode(t, etcd, func(c *kvstore.Config) {
		c.KVStoreCAFile = certs.CAFile
		c.KVStoreCertFile = certs.ClientCertFile
		c.KVStoreKeyFile = certs.ClientKeyFile
	})
	if _, err := n.client.Client().Put(ctxT(t), "tls", "ok"); err != nil {
		t.Fatal(err)
	}

	// Without the client certificate the server refuses: start fails.
	bad := newNode(t, t.TempDir(), func(c *kvstore.Config) {
		c.KVStoreEndpoints = etcd.Endpoints()
		c.KVStoreCAFile = certs.CAFile
		c.KVStoreDialTimeout = 2 * time.Second
	})
	if err := bad.start(); err == nil {
		t.Fatal("start without client certificate succeeded")
	}
}

func TestAuth(t *testing.T) {
	t.Parallel()
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	etcd.EnableAuth(t, "s3cret")
	dir := t.TempDir()
	good := filepath.Join(dir, "good")
	os.WriteFile(good, []byte("s3cret\n"), 0o600)
	wrong := filepath.Join(dir, "wrong")
	os.WriteFile(wrong, []byte("nope\n"), 0o600)

	n := startNode(t, etcd, func(c *kvstore.Config) {
		c.KVStoreUsername = "root"
		c.KVStorePasswordFile = good
	})
	if _, err := n.client.Client().Put(ctxT(t), "auth", "ok"); err != nil {
		t.Fatal(err)
	}
	if _, err := n.client.Lease(ctxT(t)); err != nil {
		t.Fatal(err)
	}

	bad := newNode(t, t.TempDir(), func(c *kvstore.Config) {
		c.KVStoreEndpoints = etcd.Endpoints()
		c.KVStoreUsername = "root"
		c.KVStorePasswordFile = wrong
	})
	err := bad.start()
	if err == nil || !strings.Contains(err.Error(), "authentication failed") {
		t.Fatalf("start with wrong password: %v", err)
	}
}

func TestEtcdDownFailsStartQuickly(t *testing.T) {
	t.Parallel()
	// A port nobody listens on: connection refused at once.
	endpoint := "http://127.0.0.1:" + freePort(t)
	n := newNode(t, t.TempDir(), func(c *kvstore.Config) {
		c.KVStoreEndpoints = []string{endpoint}
		c.KVStoreDialTimeout = time.Second
	})
	start := time.Now()
	err := n.start()
	elapsed := time.Since(start)
	if err == nil {
		t.Fatal("start succeeded without etcd")
	}
	if elapsed > 5*time.Second {
		t.Fatalf("start took %s with a 1s dial timeout", elapsed)
	}
	msg := err.Error()
	if !strings.Contains(msg, endpoint) || !strings.Contains(msg, "not reachable within 1s") || strings.Contains(msg, "\n") {
		t.Fatalf("unclear error: %q", msg)
	}
	t.Logf("error: %s", msg)
}

func TestLeaseRevokedOnStop(t *testing.T) {
	t.Parallel()
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	other := etcd.Client(t)
	n := startNode(t, etcd, nil)
	c := n.client

	id, err := c.Lease(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	if id2, _ := c.Lease(ctxT(t)); id2 != id {
		t.Fatalf("second Lease returned %x, want the same %x", id2, id)
	}
	if st := c.Status(ctxT(t)); st.LeaseID != id {
		t.Fatalf("status lease %x, want %x", st.LeaseID, id)
	}
	ttl, err := other.TimeToLive(ctxT(t), id)
	if err != nil || ttl.GrantedTTL != int64(kvstore.DefaultConfig.KVStoreLeaseTTL/time.Second) {
		t.Fatalf("lease TTL %+v, %v", ttl, err)
	}
	if _, err := c.Client().Put(ctxT(t), "ref", "1", clientv3.WithLease(id)); err != nil {
		t.Fatal(err)
	}
	if _, ok := mustGet(t, other, "ref"); !ok {
		t.Fatal("key not visible to the other client")
	}
	lost := c.LeaseLost(id)

	n.stop()
	// Immediately: the lease was revoked, not left to expire.
	if _, ok := mustGet(t, other, "ref"); ok {
		t.Fatal("key with the node's lease survived stop")
	}
	select {
	case <-lost:
	default:
		t.Fatal("LeaseLost not closed after stop")
	}
	if _, err := c.Lease(ctxT(t)); !errors.Is(err, kvstore.ErrStopped) {
		t.Fatalf("Lease after stop: %v", err)
	}
}

func TestLeaseLossDetectedOnWrite(t *testing.T) {
	t.Parallel()
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	other := etcd.Client(t)
	c := startNode(t, etcd, nil).client

	id, err := c.Lease(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	lost := c.LeaseLost(id)
	if _, err := other.Revoke(ctxT(t), id); err != nil {
		t.Fatal(err)
	}
	// The allocator's next write with the lease is refused; that alone
	// must tell the client the lease is gone.
	_, err = c.Client().Txn(ctxT(t)).Then(clientv3.OpPut("ref", "1", clientv3.WithLease(id))).Commit()
	if err == nil {
		t.Fatal("txn with revoked lease succeeded")
	}
	select {
	case <-lost:
	case <-time.After(5 * time.Second):
		t.Fatal("lease loss not noticed")
	}
	id2, err := c.Lease(ctxT(t))
	if err != nil || id2 == id || id2 == 0 {
		t.Fatalf("new lease %x (old %x): %v", id2, id, err)
	}
	if _, err := c.Client().Put(ctxT(t), "ref", "1", clientv3.WithLease(id2)); err != nil {
		t.Fatal(err)
	}
}

func TestLeaseLossDetectedByKeepAlive(t *testing.T) {
	t.Parallel()
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	other := etcd.Client(t)
	c := startNode(t, etcd, func(c *kvstore.Config) { c.KVStoreLeaseTTL = kvstore.MinLeaseTTL }).client

	id, err := c.Lease(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := other.Revoke(ctxT(t), id); err != nil {
		t.Fatal(err)
	}
	// Without any write, the keepalive notices at its next round, a third
	// of the TTL later.
	select {
	case <-c.LeaseLost(id):
	case <-time.After(kvstore.MinLeaseTTL):
		t.Fatal("keepalive did not notice the revoked lease")
	}
	if id2, err := c.Lease(ctxT(t)); err != nil || id2 == id {
		t.Fatalf("new lease %x (old %x): %v", id2, id, err)
	}
}

func TestRateLimit(t *testing.T) {
	t.Parallel()
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	const rate, requests = 50, 150
	c := startNode(t, etcd, func(c *kvstore.Config) { c.KVStoreRateLimit = rate }).client
	start := time.Now()
	for range requests {
		if _, err := c.Client().Put(ctxT(t), "rl", "x"); err != nil {
			t.Fatal(err)
		}
	}
	// A full bucket (rate) passes at once, the rest at the rate.
	min := time.Duration(float64(requests-rate)/rate*float64(time.Second)) - 100*time.Millisecond
	if elapsed := time.Since(start); elapsed < min {
		t.Fatalf("%d requests at %d/s took %s, want at least %s", requests, rate, elapsed, min)
	}
}

func TestRequestCounts(t *testing.T) {
	t.Parallel()
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	c := startNode(t, etcd, nil).client
	before := c.RequestCounts()
	cli := c.Client()
	ctx := ctxT(t)
	for range 3 {
		cli.Put(ctx, "a", "1")
	}
	cli.Get(ctx, "a")
	cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision("b"), "=", 0)).Then(clientv3.OpPut("b", "1")).Commit()
	cli.Delete(ctx, "a")
	if _, err := c.Lease(ctx); err != nil {
		t.Fatal(err)
	}
	after := c.RequestCounts()
	for method, want := range map[string]uint64{"Put": 3, "Range": 1, "Txn": 1, "DeleteRange": 1, "LeaseGrant": 1} {
		if got := after[method] - before[method]; got != want {
			t.Errorf("%s: %d requests, want %d (all: %v)", method, got, want, after)
		}
	}
}

func freePort(t testing.TB) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	_, port, _ := strings.Cut(l.Addr().String(), ":")
	return port
}

// TestTLSPermanentErrorsFailFast: a CA that did not sign etcd's
// certificate, a client certificate etcd does not trust and no client
// certificate fail the start at once, not after the dial timeout, with an error that names the flag to
// set.
func TestTLSPermanentErrorsFailFast(t *testing.T) {
	t.Parallel()
	etcd := etcdtest.StartSingle(t, etcdtest.WithTLS(nil), etcdtest.WithUnsafeNoFsync())
	certs := etcd.Certs()
	other, err := etcdtest.GenerateCerts(filepath.Join(t.TempDir(), "other"))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name      string
		endpoints []string
		ca        string
		cert, key string
		want      string
	}{
		{"unknown CA", etcd.Endpoints(), other.CAFile, certs.ClientCertFile, certs.ClientKeyFile, "set --kvstore-ca-file"},
		{"untrusted client certificate", etcd.Endpoints(), certs.CAFile, other.ClientCertFile, other.ClientKeyFile, "set --kvstore-cert-file and --kvstore-key-file"},
		{"no client certificate", etcd.Endpoints(), certs.CAFile, "", "", "set --kvstore-cert-file and --kvstore-key-file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := newNode(t, t.TempDir(), func(c *kvstore.Config) {
				c.KVStoreEndpoints = tc.endpoints
				c.KVStoreCAFile = tc.ca
				c.KVStoreCertFile = tc.cert
				c.KVStoreKeyFile = tc.key
				c.KVStoreDialTimeout = 30 * time.Second
			})
			start := time.Now()
			err := n.start()
			took := time.Since(start)
			if err == nil {
				t.Fatal("start succeeded")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error does not say %q: %v", tc.want, err)
			}
			if took > 10*time.Second {
				t.Errorf("start failed after %s with a 30s dial timeout", took)
			}
			t.Logf("%s after %s", err, took.Round(time.Millisecond))
		})
	}
}
