package kvstore_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/internal/etcdtest"
)

// connectivityScope is the health scope of the kvstore's connectivity job.
const connectivityScope = "kvstore.job-etcd-connectivity"

// startHealthNode runs the kvstore cell with health and jobs, as the agent
// does, against the cluster.
func startHealthNode(t *testing.T, etcd *etcdtest.Cluster) (*health.Provider, *kvstore.Client) {
	t.Helper()
	var (
		p *health.Provider
		c *kvstore.Client
	)
	opts := hive.DefaultOptions()
	opts.ModuleDecorators = health.ModuleDecorators
	h := hive.NewWithOptions(opts,
		health.Cell, job.Cell, statedir.Cell, kvstore.Cell,
		cell.Invoke(func(x *health.Provider, y *kvstore.Client) { p, c = x, y }),
	)
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = t.TempDir() })
	hive.AddConfigOverride(h, func(c *kvstore.Config) {
		c.NodeName = "test-node"
		c.KVStoreEndpoints = etcd.Endpoints()
		c.KVStoreDialTimeout = 5 * time.Second
		c.KVStoreRequestTimeout = 2 * time.Second
	})
	log := hivetest.Logger(t)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	if err := h.Start(log, ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		h.Stop(log, ctx)
	})
	return p, c
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
