package allocatortest_test

import (
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/allocator/globalstore/storetest"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/allocatortest"
	"github.com/identityd/identityd/internal/testhive"
)

// TestConformance runs the contract of global stores on the in-memory
// store that the allocator's tests use in place of etcd.
func TestConformance(t *testing.T) {
	cluster := identity.ClusterInfo{Name: "default"}
	stores := map[string]*allocatortest.Store{}
	storetest.Run(t, storetest.Harness{
		Mode:    identity.AllocationModeKVStore,
		Cluster: cluster,
		Start: func(t *testing.T, name string, cells ...cell.Cell) (globalstore.Backend, func()) {
			// One store per test, shared by its nodes.
			s, ok := stores[t.Name()]
			if !ok {
				s = allocatortest.NewStore(cluster)
				stores[t.Name()] = s
			}
			b := s.NewBackend(name)
			h := hive.New(append([]cell.Cell{
				cell.Provide(globalstore.NewSinks, func() identity.AllocationMode { return identity.AllocationModeKVStore }),
				allocatortest.BackendCell(b),
				cell.Invoke(func(globalstore.Backend) {}),
			}, cells...)...)
			return b, testhive.Start(t, h).Stop
		},
		Collect: func(t *testing.T, b globalstore.Backend) {
			stores[t.Name()].GC()
		},
	})
}
