package etcdstore

import (
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/allocator/globalstore/storetest"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/testhive"
)

// TestConformance runs the contract of global stores on the etcd store,
// each node in a hive of its own with the kvstore client, on one etcd.
func TestConformance(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cluster := identity.ClusterInfo{Name: "default"}
	storetest.Run(t, storetest.Harness{
		Mode:    identity.AllocationModeKVStore,
		Cluster: cluster,
		Start: func(t *testing.T, name string, cells ...cell.Cell) (globalstore.Backend, func()) {
			var b *Store
			h := hive.New(append([]cell.Cell{
				statedir.Cell, job.Cell, kvstore.Cell, Cell,
				cell.Config(globalstore.DefaultConfig),
				cell.Provide(func() identity.ClusterInfo { return cluster }, globalstore.NewSinks),
				cell.Invoke(func(s *Store) { b = s }),
			}, cells...)...)
			configureNode(t, h, c, name)
			running, err := testhive.TryStart(t, h, nodeLogger(t))
			if err != nil {
				t.Fatal(err)
			}
			return b, running.Stop
		},
		Collect: func(t *testing.T, b globalstore.Backend) {
			if _, err := b.(*Store).collect(t.Context()); err != nil {
				t.Fatal(err)
			}
		},
	})
}
