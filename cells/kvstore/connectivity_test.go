package kvstore_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/testhive"
)

// connectivityScope is the health scope of the kvstore's connectivity job.
const connectivityScope = "kvstore.job-etcd-connectivity"

// healthNode is the kvstore cell in a hive with health and jobs, as the
// agent runs it.
type healthNode struct {
	p       *health.Provider
	c       *kvstore.Client
	running *testhive.Running
}

// startHealthNode runs the kvstore cell with health and jobs, as the agent
// does, against the cluster.
func startHealthNode(t *testing.T, etcd *etcdtest.Cluster) (*health.Provider, *kvstore.Client) {
	n := newHealthNode(t, etcd, nil)
	return n.p, n.c
}

// newHealthNode is startHealthNode with the config changed by configure
// (if not nil) and the extra cells in the hive.
func newHealthNode(t *testing.T, etcd *etcdtest.Cluster, configure func(*kvstore.Config), extra ...cell.Cell) *healthNode {
	t.Helper()
	n := &healthNode{}
	opts := hive.DefaultOptions()
	opts.ModuleDecorators = health.ModuleDecorators
	h := hive.NewWithOptions(opts, append([]cell.Cell{
		health.Cell, job.Cell, statedir.Cell, kvstore.Cell,
		cell.Invoke(func(x *health.Provider, y *kvstore.Client) { n.p, n.c = x, y }),
	}, extra...)...)
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = t.TempDir() })
	hive.AddConfigOverride(h, func(c *kvstore.Config) {
		c.NodeName = "test-node"
		c.KVStoreEndpoints = etcd.Endpoints()
		c.KVStoreDialTimeout = 5 * time.Second
		c.KVStoreRequestTimeout = 2 * time.Second
		if configure != nil {
			configure(c)
		}
	})
	n.running = testhive.Start(t, h)
	return n
}

// waitScope waits until the scope's status satisfies ok, and returns it.
func waitScope(t *testing.T, p *health.Provider, name string, within time.Duration, what string, ok func(health.Status) bool) health.Status {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		for _, st := range p.All() {
			if st.Name == name && ok(st) {
				return st
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not %s within %s:\n%s", name, what, within, health.Format(p.All()))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func isOK(st health.Status) bool {
	return st.Level == cell.StatusOK && strings.HasPrefix(st.Message, "etcd answers")
}

// The connectivity job turns the kvstore Degraded, with a cause outside
// the agent, when the etcd member it reaches knows no leader (quorum lost)
// and when no member answers at all, and OK again when the cluster is back.
func TestConnectivityHealth(t *testing.T) {
	t.Parallel()
	etcd := etcdtest.StartCluster(t, 3, etcdtest.WithUnsafeNoFsync())
	p, c := startHealthNode(t, etcd)
	waitScope(t, p, connectivityScope, 30*time.Second, "OK", isOK)
	if live, _ := p.Live(); !live {
		t.Fatalf("not live with etcd up:\n%s", health.Format(p.All()))
	}

	// Two of three members gone: the last one answers its status but
	// knows no leader, so no write can succeed.
	etcd.Member(1).Kill()
	etcd.Member(2).Kill()
	st := waitScope(t, p, connectivityScope, 30*time.Second, "Degraded for lack of a leader", func(st health.Status) bool {
		return st.Level == cell.StatusDegraded && strings.Contains(st.Error, "knows no leader")
	})
	if !st.External {
		t.Errorf("quorum loss not marked as an external cause: %+v", st)
	}
	// The first check after the kill may still reach a dead member.
	etcd.Member(0).Kill()
	killed := time.Now()
	st = waitScope(t, p, connectivityScope, 30*time.Second, "Degraded with no member", func(st health.Status) bool {
		return st.Level == cell.StatusDegraded && !strings.Contains(st.Error, "knows no leader") && st.Updated.After(killed)
	})
	if !st.External || !strings.HasPrefix(st.Message, "No etcd endpoint answered") {
		t.Errorf("no member: %+v", st)
	}
	if ready, _ := p.Healthy(); ready {
		t.Error("ready with etcd down")
	}
	if live, dead := p.Live(); !live {
		t.Errorf("not live with etcd down: %+v", dead)
	}
	if s := c.Status(t.Context()); s.LastError == "" {
		t.Error("kvstore/status shows no last error")
	}

	etcd.RestartAll()
	etcd.WaitLeader(t)
	back := time.Now()
	waitScope(t, p, connectivityScope, 30*time.Second, "OK again", isOK)
	t.Logf("OK again %s after the cluster had a leader", time.Since(back).Round(time.Millisecond))
	if ready, bad := p.Healthy(); !ready {
		t.Errorf("not ready after etcd returned: %+v", bad)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if _, err := c.Client().Put(ctx, "k", "v", clientv3.WithPrevKV()); err != nil {
		t.Errorf("put after etcd returned: %v", err)
	}
}

// A lost lease shows in health with an external cause, and the node gets a
// new lease once etcd answers, even when it writes nothing: without that
// the kvstore stayed Degraded (and the agent not ready) until its next
// write, which on a quiet node may never come.
func TestLostLeaseHealthRecovers(t *testing.T) {
	t.Parallel()
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	p, c := startHealthNode(t, etcd)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	old, err := c.Lease(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := etcd.Client(t).Revoke(ctx, old); err != nil {
		t.Fatal(err)
	}
	// A write with the revoked lease is refused: the client notices at
	// once.
	if _, err := c.Client().Put(ctx, "ref", "1", clientv3.WithLease(old)); err == nil {
		t.Fatal("put with a revoked lease succeeded")
	}
	<-c.LeaseLost(old)
	// The report precedes the channel's close. The job grants the new
	// lease at its next check, up to 2s later; should it have come first,
	// the report says OK and names the new lease's grant.
	for _, st := range p.All() {
		if st.Name != "kvstore" {
			continue
		}
		if st.Level == cell.StatusDegraded {
			if !st.External || !strings.Contains(st.Message, "Lost this node's etcd lease") {
				t.Errorf("lost lease: %+v", st)
			}
		} else if lease := c.Status(ctx).LeaseID; lease == 0 || lease == old {
			t.Errorf("kvstore %s with lease %x after losing %x", st.Level, lease, old)
		}
	}
	waitScope(t, p, "kvstore", 15*time.Second, "OK again", func(st health.Status) bool { return st.Level == cell.StatusOK })
	if lease := c.Status(ctx).LeaseID; lease == 0 || lease == old {
		t.Fatalf("lease %x after losing %x", lease, old)
	}
}

// TestLeaseLostWaitsForReport: LeaseLost of a lease just lost does not
// return before health heard of the loss, even once the client has
// forgotten the lease. It returned a closed channel in that moment, and a
// caller acting on it saw the client neither degraded nor holding a lease.
func TestLeaseLostWaitsForReport(t *testing.T) {
	t.Parallel()
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	p, c := startHealthNode(t, etcd)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	old, err := c.Lease(ctx)
	if err != nil {
		t.Fatal(err)
	}
	release := kvstore.HoldHealthReports(c)
	released := false
	defer func() {
		if !released {
			release()
		}
	}()
	if _, err := etcd.Client(t).Revoke(ctx, old); err != nil {
		t.Fatal(err)
	}
	// A write with the revoked lease is refused, and the client forgets
	// the lease; its report waits for release, and so does the write.
	go c.Client().Put(ctx, "ref", "1", clientv3.WithLease(old)) //nolint:errcheck // refused
	for c.Status(ctx).LeaseID == old {
		if ctx.Err() != nil {
			t.Fatal("the client never forgot its revoked lease")
		}
		time.Sleep(5 * time.Millisecond)
	}
	lost := c.LeaseLost(old)
	select {
	case <-lost:
		t.Fatal("LeaseLost closed before health heard of the loss")
	case <-time.After(200 * time.Millisecond):
	}
	release()
	released = true
	select {
	case <-lost:
	case <-ctx.Done():
		t.Fatal("LeaseLost never closed")
	}
	for _, st := range p.All() {
		if st.Name == "kvstore" && st.Level != cell.StatusDegraded {
			if lease := c.Status(ctx).LeaseID; lease == 0 || lease == old {
				t.Errorf("kvstore %s with lease %x after losing %x", st.Level, lease, old)
			}
		}
	}
}

// keepaliveScope is the health scope of the kvstore's keepalive job.
const keepaliveScope = "kvstore.job-" + kvstore.KeepaliveJob

// TestKeepaliveJob: in a hive with jobs and health, the lease's keepalive
// runs as a job with its own health scope; it notices a lease revoked by
// someone else, and it keeps the lease until the client's own stop, after
// the stop hooks of the cells that use the client: one of them still
// writes with the lease, and the revoke removes that key at once.
func TestKeepaliveJob(t *testing.T) {
	t.Parallel()
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	other := etcd.Client(t)
	lateWrite := make(chan error, 1)
	// A cell using the client: its stop hook runs before the client's and
	// writes with the lease, as the allocator's releases may.
	user := cell.Module("user", "writes at stop", cell.Invoke(func(lc cell.Lifecycle, kv *kvstore.Client) {
		lc.Append(cell.Hook{OnStop: func(ctx cell.HookContext) error {
			id, err := kv.Lease(ctx)
			if err == nil && closedNow(kv.LeaseLost(id)) {
				err = fmt.Errorf("lease %x lost before the client's stop", int64(id))
			}
			if err == nil {
				_, err = kv.Client().Put(ctx, "late", "1", clientv3.WithLease(id))
			}
			lateWrite <- err
			return nil
		}})
	}))
	n := newHealthNode(t, etcd, func(c *kvstore.Config) { c.KVStoreLeaseTTL = kvstore.MinLeaseTTL }, user)
	p, c := n.p, n.c

	message := func(prefix string) func(health.Status) bool {
		return func(st health.Status) bool {
			return st.Level == cell.StatusOK && strings.HasPrefix(st.Message, prefix)
		}
	}
	waitScope(t, p, keepaliveScope, 30*time.Second, "OK without a lease", message("No lease held"))
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	id, err := c.Lease(ctx)
	if err != nil {
		t.Fatal(err)
	}
	keeping := fmt.Sprintf("Keeping lease %x alive", int64(id))
	waitScope(t, p, keepaliveScope, 30*time.Second, "keeping the lease", message(keeping))

	// Revoked by someone else, with no write: only the keepalive can
	// notice, at its next round, a third of the TTL later. The
	// connectivity job may grant a new lease right after.
	if _, err := other.Revoke(ctx, id); err != nil {
		t.Fatal(err)
	}
	waitScope(t, p, keepaliveScope, kvstore.MinLeaseTTL, "done with the revoked lease", func(st health.Status) bool {
		return st.Level == cell.StatusOK && st.Message != keeping
	})
	if !closedNow(c.LeaseLost(id)) {
		t.Fatal("keepalive job moved on, but the revoked lease is not marked lost")
	}
	id2, err := c.Lease(ctx)
	if err != nil || id2 == id {
		t.Fatalf("new lease %x (old %x): %v", id2, id, err)
	}
	waitScope(t, p, keepaliveScope, 30*time.Second, "keeping the new lease", message(fmt.Sprintf("Keeping lease %x alive", int64(id2))))
	if _, err := c.Client().Put(ctx, "ref", "1", clientv3.WithLease(id2)); err != nil {
		t.Fatal(err)
	}

	n.running.Stop()
	if err := <-lateWrite; err != nil {
		t.Fatalf("write with the lease in a stop hook: %v", err)
	}
	// Immediately: the lease was revoked, not left to expire.
	for _, key := range []string{"ref", "late"} {
		if _, ok := mustGet(t, other, key); ok {
			t.Errorf("key %s with the node's lease survived stop", key)
		}
	}
	st := waitScope(t, p, keepaliveScope, 0, "listed after stop", func(health.Status) bool { return true })
	if st.Level != cell.StatusStopped {
		t.Errorf("keepalive scope after stop: %+v", st)
	}
}

// closedNow reports whether ch is closed already.
func closedNow(ch <-chan struct{}) (closed bool) {
	select {
	case <-ch:
		closed = true
	default:
	}
	return closed
}
