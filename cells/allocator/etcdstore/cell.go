package etcdstore

import (
	"github.com/cilium/hive/cell"
)

// Cell provides the globalstore.Backend that keeps global identities in
// etcd with Cilium's key layout, when the hive has a *kvstore.Client;
// without one it provides none and the allocator serves local identities
// only. It takes the cluster's ID range as an identity.ClusterInfo (the
// allocator cell provides it) and registers the store's flags
// (--allocator-list-timeout, --identity-gc-*, --kvstore-periodic-sync).
// The store's loops are jobs of this module: the watch of the master keys,
// the lease repair, the GC and the periodic sync of this node's keys.
var Cell = cell.Module(
	"etcdstore",
	"Global identities in etcd",

	cell.Config(DefaultConfig),
	cell.Provide(newBackend, newStoreMetrics),
)
