package clustermesh

import (
	"github.com/cilium/hive/cell"
)

// Cell provides the *Mesh that follows remote clusters' identities, one
// file per cluster in --clustermesh-config, as the allocator's
// globalstore.Remote; its clustermesh/status command and the
// identityd_clustermesh_remote_cluster_* metrics. It takes this cluster's
// identity.ClusterInfo from the allocator cell, to refuse remote clusters
// whose ID clashes with it. Its loop (the poll of the directory, and under
// it one connection per cluster) is the job clustermesh-config-poll.
var Cell = cell.Module(
	"clustermesh",
	"Identities of remote clusters",

	cell.Config(DefaultConfig),
	cell.Provide(
		newMesh,
		newClusterMeshCommands,
		newClusterMeshMetrics,
	),
)
