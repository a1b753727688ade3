package kvstore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/internal/etcdtest"
)

// TestStopWithEtcdGone: with etcd killed, the client's stop (the lease's
// revoke, then the close) ends within the stop budget, and a request still
// in flight, bounded only by the default request timeout, ends with it.
func TestStopWithEtcdGone(t *testing.T) {
	t.Parallel()
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	n := startNode(t, etcd, nil)
	c := n.client
	if c.RequestTimeout() != kvstore.DefaultConfig.KVStoreRequestTimeout {
		t.Fatalf("request timeout %s, want the default", c.RequestTimeout())
	}
	if _, err := c.Lease(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	select {
	case <-c.Stopping():
		t.Fatal("Stopping closed before the stop")
	default:
	}
	etcd.Member(0).Kill()

	inFlight := make(chan error, 1)
	go func() {
		rctx, cancel := c.RequestContext(context.Background())
		defer cancel()
		_, err := c.Client().Get(rctx, "key")
		inFlight <- err
	}()

	start := time.Now()
	n.stop()
	took := time.Since(start)
	t.Logf("stopped in %s with etcd gone", took.Round(time.Millisecond))
	if took > 10*time.Second {
		t.Fatalf("stop took %s with etcd gone, want under 10s (budget %s)", took, kvstore.StopBudget)
	}
	select {
	case <-c.Stopping():
	default:
		t.Fatal("Stopping not closed after the stop")
	}
	select {
	case err := <-inFlight:
		if err == nil {
			t.Fatal("request succeeded with etcd gone")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("request in flight still waiting 10s after the stop")
	}
}

// TestStopContextShared: the stop path's calls share one deadline, fixed by
// the first.
func TestStopContextShared(t *testing.T) {
	t.Parallel()
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	n := startNode(t, etcd, nil)
	c := n.client
	ctx1, cancel1 := c.StopContext(context.Background())
	defer cancel1()
	d1, ok := ctx1.Deadline()
	if !ok || time.Until(d1) > kvstore.StopBudget {
		t.Fatalf("first stop context: deadline %v (%v), want within %s", d1, ok, kvstore.StopBudget)
	}
	ctx2, cancel2 := c.StopContext(context.Background())
	defer cancel2()
	if d2, _ := ctx2.Deadline(); !d2.Equal(d1) {
		t.Fatalf("second stop context ends at %v, want the first's %v", d2, d1)
	}
	// Requests work until the deadline, then end with it.
	rctx, cancel := c.RequestContext(context.Background())
	defer cancel()
	if _, err := c.Client().Put(rctx, "k", "v"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-rctx.Done():
		if !errors.Is(rctx.Err(), context.Canceled) {
			t.Fatalf("request context: %v", rctx.Err())
		}
	case <-time.After(kvstore.StopBudget + 10*time.Second):
		t.Fatal("request context not ended at the stop deadline")
	}
}
