package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"path/filepath"
	"runtime/pprof"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/spf13/pflag"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/labels"
)

// hiveNode is one node of the agent's composition run as a hive in the
// test process, as an agent outside this module composes the cells.
type hiveNode struct {
	h     *hive.Hive
	alloc allocator.Allocator
	kv    *kvstore.Client
	dir   string
}

func startHiveNode(t *testing.T, dir string, args ...string) *hiveNode {
	t.Helper()
	n := &hiveNode{dir: dir}
	n.h = newHive(cell.Invoke(func(a allocator.Allocator, kv *kvstore.Client) { n.alloc, n.kv = a, kv }))
	flags := pflag.NewFlagSet("agent", pflag.ContinueOnError)
	n.h.RegisterFlags(flags)
	if err := flags.Parse(append([]string{"--state-dir", dir, "--ipcache-map", "file",
		"--prometheus-serve-addr", "127.0.0.1:0", "--kvstore-request-timeout", "1s"}, args...)); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := n.h.Start(hivetest.Logger(t), ctx); err != nil {
		t.Fatal(err)
	}
	return n
}

// stop stops the node's hive within hive's own stop timeout and returns
// how long that took. A stop that takes longer than 10s logs every
// goroutine's stack as it was at 10s: what the stop waited for.
func (n *hiveNode) stop(t *testing.T) (time.Duration, error) {
	ctx, cancel := context.WithTimeout(context.Background(), hive.DefaultOptions().StopTimeout)
	defer cancel()
	var stacks bytes.Buffer
	dumped := make(chan struct{})
	dump := time.AfterFunc(10*time.Second, func() {
		defer close(dumped)
		pprof.Lookup("goroutine").WriteTo(&stacks, 2)
	})
	start := time.Now()
	err := n.h.Stop(hivetest.Logger(t), ctx)
	took := time.Since(start)
	if !dump.Stop() {
		<-dumped
		t.Logf("goroutines 10s into the stop:\n%s", stacks.String())
	}
	return took, err
}

// TestTwoNodesStopWithoutEtcd runs two nodes of the agent's composition in
// the test process: one on its embedded etcd, the other on that etcd as its
// external endpoint, both with a kvstore request timeout of 1s and a
// global identity each. The embedded etcd's node stops first, which takes
// the etcd away; the other node's stop must still end within 10s, without
// error, and leave no goroutine behind. (The collector election's campaign,
// cancelled by the stop, used to resign with a delete that nothing
// bounded: the stop ran into hive's stop timeout, and the etcd client's
// goroutines stayed.)
func TestTwoNodesStopWithoutEtcd(t *testing.T) {
	// The agent binary that TestMain may be building meanwhile runs go
	// commands, whose output copying is no node's.
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent(),
		goleak.IgnoreAnyFunction("os/exec.(*Cmd).writerDescriptor.func1"),
		goleak.IgnoreAnyFunction("os/exec.(*Cmd).watchCtx"))
	root := t.TempDir()
	a := startHiveNode(t, filepath.Join(root, "a"), "--node-name", "node-a")
	tls := filepath.Join(a.dir, "etcd-tls")
	// A third candidate for the collection, older than the other node's
	// and never gone: that node's campaign is waiting when etcd goes.
	// (Without it, the embedded etcd's node revoking its candidacy on the
	// way down may or may not make the other node the collector first.)
	cli := tlsClient(t, a.kv.Endpoints(), tls)
	third, err := cli.Grant(t.Context(), 600)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(t.Context(), fmt.Sprintf("%s/%x", etcdstore.CollectorKeyPrefix, int64(third.ID)), "node-c",
		clientv3.WithLease(third.ID)); err != nil {
		t.Fatal(err)
	}
	cli.Close()
	b := startHiveNode(t, filepath.Join(root, "b"), "--node-name", "node-b",
		"--kvstore-endpoints", strings.Join(a.kv.Endpoints(), ","),
		"--kvstore-ca-file", filepath.Join(tls, "ca.crt"),
		"--kvstore-cert-file", filepath.Join(tls, "client.crt"),
		"--kvstore-key-file", filepath.Join(tls, "client.key"))
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	lbls := labels.MustParse("k8s:app=web", "k8s:io.kubernetes.pod.namespace=prod")
	ia, _, err := a.alloc.Allocate(ctx, lbls)
	if err != nil {
		t.Fatal(err)
	}
	ib, _, err := b.alloc.Allocate(ctx, lbls)
	if err != nil {
		t.Fatal(err)
	}
	if ia.ID != ib.ID {
		t.Fatalf("the nodes gave the label set %d and %d", ia.ID, ib.ID)
	}

	if took, err := a.stop(t); err != nil {
		t.Fatalf("stopping the embedded etcd's node: %v (after %s)", err, took)
	}
	took, err := b.stop(t)
	t.Logf("the other node stopped in %s without etcd", took.Round(time.Millisecond))
	if err != nil {
		t.Fatalf("stopping the other node without etcd: %v", err)
	}
	if took > 10*time.Second {
		t.Fatalf("the other node's stop took %s without etcd, want within 10s", took)
	}
}

// tlsClient is a client of the embedded etcd at endpoints, with the
// certificates the agent wrote to its etcd-tls directory dir.
func tlsClient(t *testing.T, endpoints []string, dir string) *clientv3.Client {
	t.Helper()
	cert, err := tls.LoadX509KeyPair(filepath.Join(dir, "client.crt"), filepath.Join(dir, "client.key"))
	if err != nil {
		t.Fatal(err)
	}
	ca, err := os.ReadFile(filepath.Join(dir, "ca.crt"))
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca)
	cli, err := clientv3.New(clientv3.Config{Endpoints: endpoints, DialTimeout: 10 * time.Second,
		TLS: &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: pool, MinVersion: tls.VersionTLS12}})
	if err != nil {
		t.Fatal(err)
	}
	return cli
}
