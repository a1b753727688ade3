package allocator

import (
	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"

	"github.com/identityd/identityd/identity"
)

// Cell provides the Allocator, the read-only identities table
// (statedb.Table[Entry]), the identity/* shell commands and the cluster's
// identity.ClusterInfo (--cluster-id, --cluster-name,
// --max-connected-clusters) that the stores take their ID range from. A
// globalstore.Backend in the hive (etcdstore.Cell's) enables global
// identities; without one, allocating a global label set fails with
// ErrNoGlobalBackend. A globalstore.Remote (clustermesh.Cell's) adds
// remote clusters' identities to lookups and Observe.
//
// Other cells register with it: identity handlers (NewHandler), the
// restoration that local allocations wait for (NewRestoration) and the
// finalizers its stop hook runs (NewFinalizer).
var Cell = cell.Module(
	"allocator",
	"Security identity allocator",

	cell.Config(DefaultConfig),
	cell.ProvidePrivate(NewTable),
	// Public so that its collector reaches the metrics registry.
	cell.Provide(newAllocationMetrics),
	cell.Provide(
		statedb.RWTable[Entry].ToTable,
		newAllocator,
		newCellCommands,
		clusterInfo,
		newIdentityMetrics,
	),
	cell.Invoke(registerHandlers, registerContracts),
)

// clusterInfo gives the stores this cluster's ID range, refusing an invalid
// configuration before any store is built with it.
func clusterInfo(c Config) (identity.ClusterInfo, error) {
	if err := c.Validate(); err != nil {
		return identity.ClusterInfo{}, err
	}
	return c.ClusterInfo(), nil
}
