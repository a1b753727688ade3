package etcdtest_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"

	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/testproc"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// put retries: right after a member loss a write may time out while a new
// leader is elected.
func put(t *testing.T, cli *clientv3.Client, key, val string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		_, err := cli.Put(ctx, key, val)
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("put %s: %v", key, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func get(t *testing.T, cli *clientv3.Client, key string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	resp, err := cli.Get(ctx, key)
	if err != nil {
		t.Fatalf("get %s: %v", key, err)
	}
	if len(resp.Kvs) == 0 {
		return ""
	}
	return string(resp.Kvs[0].Value)
}

func TestSingleRestartKeepsData(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	put(t, cli, "k", "v")

	m := c.Member(0)
	pid := m.PID()
	m.Restart()
	if m.PID() == pid || m.PID() == 0 {
		t.Fatalf("restart kept pid %d / not running", pid)
	}
	c.WaitLeader(t)
	if got := get(t, cli, "k"); got != "v" {
		t.Fatalf("after restart got %q, want v", got)
	}

	m.Kill()
	if m.Running() {
		t.Fatal("killed member still running")
	}
	m.Restart()
	c.WaitLeader(t)
	if got := get(t, cli, "k"); got != "v" {
		t.Fatalf("after kill and restart got %q, want v", got)
	}
}

func TestClusterSurvivesMemberLoss(t *testing.T) {
	c := etcdtest.StartCluster(t, 3, etcdtest.WithUnsafeNoFsync())
	if n := len(c.Endpoints()); n != 3 {
		t.Fatalf("%d endpoints, want 3", n)
	}
	cli := c.Client(t)
	put(t, cli, "a", "1")

	leader := c.Leader(t)
	c.Member(leader).Kill()
	put(t, cli, "b", "2")

	follower := (leader + 1) % 3
	c.Member(follower).Pause()
	// Two of three down: no quorum, writes must time out.
	ctx, cancel := context.WithTimeout(t.Context(), time.Second)
	_, err := cli.Put(ctx, "c", "3")
	cancel()
	if err == nil {
		st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", c.Member(follower).PID()))
		t.Fatalf("write succeeded without quorum (leader %d killed, running %v, follower %d paused: %s)", leader, c.Member(leader).Running(), follower, st)
	}
	c.Member(follower).Resume()
	c.Member(leader).Restart()
	c.WaitLeader(t)
	put(t, cli, "c", "3")
	if got := get(t, cli, "b"); got != "2" {
		t.Fatalf("got %q, want 2", got)
	}
}

func TestTLSAndAuth(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithTLS(nil), etcdtest.WithUnsafeNoFsync())
	if c.Certs() == nil {
		t.Fatal("no certs generated")
	}
	cli := c.Client(t)
	put(t, cli, "k", "v")

	// Without a client certificate the server refuses.
	cfg, err := c.ClientConfig()
	if err != nil {
		t.Fatal(err)
	}
	cfg.TLS = cfg.TLS.Clone()
	cfg.TLS.Certificates = nil
	bare, err := clientv3.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer bare.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
	_, err = bare.Get(ctx, "k")
	cancel()
	if err == nil {
		t.Fatal("get without client certificate succeeded")
	}

	c.EnableAuth(t, "s3cret")
	authed := c.Client(t)
	if got := get(t, authed, "k"); got != "v" {
		t.Fatalf("got %q, want v", got)
	}
	// Restarting waits with credentials; auth stays on.
	c.Member(0).Restart()
	c.WaitLeader(t)
	if got := get(t, authed, "k"); got != "v" {
		t.Fatalf("after restart got %q, want v", got)
	}
}

// TestStoppedMemberKeepsItsPorts: while a member is down, no other server
// can get its ports, or its clients would reach that server instead (an
// outage test would see etcd answer). A bind that does not share the port
// fails, a connection is refused as by a stopped etcd, and the restarted
// member serves on the same port.
func TestStoppedMemberKeepsItsPorts(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	m := c.Member(0)
	u, err := url.Parse(m.Endpoint())
	if err != nil {
		t.Fatal(err)
	}
	port, _ := strconv.Atoi(u.Port())
	for _, stop := range []func(){m.Stop, m.Kill} {
		stop()
		if err := testproc.Bindable(port); !errors.Is(err, syscall.EADDRINUSE) {
			t.Fatalf("binding the stopped member's port %d: %v, want %v", port, err, syscall.EADDRINUSE)
		}
		if conn, err := net.DialTimeout("tcp", u.Host, time.Second); !errors.Is(err, syscall.ECONNREFUSED) {
			if conn != nil {
				conn.Close()
			}
			t.Fatalf("connecting to the stopped member: %v, want %v", err, syscall.ECONNREFUSED)
		}
		m.Restart()
		c.WaitLeader(t)
		put(t, c.Client(t), "k", "v")
	}
}
