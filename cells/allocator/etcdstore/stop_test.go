package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/testhive"
	"github.com/identityd/identityd/labels"
)

// TestEtcdStopWithEtcdGone stops a hive whose etcd was killed, with the
// default --kvstore-request-timeout and the GC running: a cell releases its
// global identities in its stop hook (as an agent's endpoints would), an
// allocation is waiting for etcd, and the backend revokes the lease. Each
// of these used to wait a request timeout in turn, together past hive's
// stop timeout; now the stop path shares one short deadline, releases
// while stopping send no delete (the lease's end removes the references),
// and the stop ends within seconds, without error.
func TestEtcdStopWithEtcdGone(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	testEtcdStop(t, c, true)
}

// TestEtcdStopReleasesReferences: with etcd reachable, the same stop, whose
// releases send no delete, leaves none of the node's references behind:
// the lease's revoke removes them at once.
func TestEtcdStopReleasesReferences(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	testEtcdStop(t, c, false)
	if n := countKeys(t, c.Client(t), ReferenceKeyPrefix); n != 0 {
		t.Fatalf("%d reference keys left after the stop", n)
	}
}

func testEtcdStop(t *testing.T, c *etcdtest.Cluster, killEtcd bool) {
	var (
		alloc allocator.Allocator
		held  []*identity.Identity
	)
	h := hive.New(
		statedir.Cell, job.Cell, statedb.Cell, kvstore.Cell, allocator.Cell, Cell,
		cell.Invoke(func(lc cell.Lifecycle, a allocator.Allocator) {
			alloc = a
			lc.Append(cell.Hook{OnStop: func(ctx cell.HookContext) error {
				for _, id := range held {
					if _, err := a.Release(ctx, id); err != nil {
						return fmt.Errorf("release %d: %w", id.ID, err)
					}
				}
				return nil
			}})
		}),
	)
	stateDir := t.TempDir()
	hive.AddConfigOverride(h, func(cfg *statedir.Config) { cfg.StateDir = stateDir })
	hive.AddConfigOverride(h, func(cfg *kvstore.Config) {
		cfg.KVStoreEndpoints = c.Endpoints()
		cfg.NodeName = "node1"
		if cfg.KVStoreRequestTimeout != kvstore.DefaultConfig.KVStoreRequestTimeout {
			t.Fatalf("request timeout %s, want the default", cfg.KVStoreRequestTimeout)
		}
	})
	hive.AddConfigOverride(h, func(cfg *globalstore.Config) { cfg.IdentityGCInterval = 100 * time.Millisecond })
	running := testhive.Start(t, h)
	for i := range 3 {
		id, _, err := alloc.Allocate(testCtx(t, 30*time.Second), labels.MustParse(fmt.Sprintf("k8s:app=web-%d", i)))
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, id)
	}

	if n := countKeys(t, c.Client(t), ReferenceKeyPrefix); n != 3 {
		t.Fatalf("%d reference keys, want 3", n)
	}
	waiting := make(chan error, 1)
	if killEtcd {
		c.Member(0).Kill()
		// An allocation that waits for etcd while the agent stops.
		go func() {
			_, _, err := alloc.Allocate(context.Background(), labels.MustParse("k8s:app=late"))
			waiting <- err
		}()
	} else {
		waiting <- errors.New("none waiting")
	}

	start := time.Now()
	// Within testhive.Timeout, a minute: hive's own stop timeout. A
	// stop error fails the test.
	running.Stop()
	took := time.Since(start)
	t.Logf("stopped in %s (etcd killed: %v)", took.Round(time.Millisecond), killEtcd)
	// Generous for a loaded machine, far below one request timeout.
	if took > 10*time.Second {
		t.Errorf("stop took %s with etcd gone, want under 10s", took)
	}
	select {
	case err := <-waiting:
		if err == nil {
			t.Error("allocation succeeded with etcd gone")
		}
	case <-time.After(time.Minute):
		t.Fatal("allocation still waiting a minute after the stop")
	}
}
