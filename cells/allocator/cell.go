package allocator

import (
	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
)

// Cell provides the Allocator, the read-only identities table
// (statedb.Table[Entry]) and the identity/* shell commands. A GlobalBackend
// in the hive (the kvstore cell's etcd backend) enables global identities;
// without one, allocating a global label set fails with ErrNoGlobalBackend.
// It also provides the *ClusterMesh that follows remote clusters'
// identities (--clustermesh-config), its clustermesh/status command and
// metrics.
//
// Other cells register with it: identity handlers (NewHandler), the
// restoration that local allocations wait for (NewRestoration) and the
// finalizers its stop hook runs (NewFinalizer).
var Cell = cell.Module(
	"allocator",
	"Security identity allocator",

	cell.Config(DefaultConfig),
	cell.Config(DefaultEtcdConfig),
	cell.Config(DefaultClusterMeshConfig),
	cell.ProvidePrivate(NewTable),
	// Public so that its collector reaches the metrics registry.
	cell.Provide(newAllocationMetrics),
	cell.Provide(
		statedb.RWTable[Entry].ToTable,
		newAllocator,
		newEtcdBackend,
		newCellCommands,
		newClusterMesh,
		newClusterMeshCommands,
		newClusterMeshMetrics,
	),
	cell.Invoke(registerHandlers, registerContracts),
)
