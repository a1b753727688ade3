package allocator

import (
	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/identity"
)

// Cell provides the Allocator, the read-only identities table
// (statedb.Table[Entry]), the identity/* shell commands, the cluster's
// identity.ClusterInfo (--cluster-id, --cluster-name,
// --max-connected-clusters) that the stores take their ID range from, the
// configured identity.AllocationMode, the stores' shared
// globalstore.Config and the globalstore.Sinks they report to. Which store serves global identities, and how other
// cells register with the allocator: the package documentation.
var Cell = cell.Module(
	"allocator",
	"Security identity allocator",

	cell.Config(DefaultConfig),
	// The stores' shared flags, registered once for every driver.
	cell.Config(globalstore.DefaultConfig),
	cell.ProvidePrivate(NewTable),
	// Public so that its collector reaches the metrics registry.
	cell.Provide(newAllocationMetrics),
	cell.Provide(
		statedb.RWTable[Entry].ToTable,
		newAllocator,
		newCellCommands,
		clusterInfo,
		allocationMode,
		newIdentityMetrics,
		globalstore.NewSinks,
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

// allocationMode gives the stores and the kvstore cell the configured mode,
// refusing an invalid configuration.
func allocationMode(c Config) (identity.AllocationMode, error) {
	if err := c.Validate(); err != nil {
		return "", err
	}
	return c.IdentityAllocationMode, nil
}
