package etcdstore

import (
	"github.com/cilium/hive/cell"
)

// Cell offers the allocator the etcd store of global identities, with
// Cilium's key layout, as the globalstore.Driver of kvstore mode and as
// the globalstore.Mirror the double-write modes compose
// (cells/allocator/doublewrite), and provides the *Store itself. Without a *kvstore.Client in the hive, or
// with --identity-allocation-mode=crd, the *Store is nil, the driver's
// backend is nil and nothing starts; the allocator then serves local
// identities only (or the CRD store's, in crd mode). It takes the
// cluster's ID range as an identity.ClusterInfo and the stores' shared
// flags as a globalstore.Config (the allocator cell provides both), and
// registers --kvstore-periodic-sync. The store's loops are jobs of this
// module: the watch of the master keys, the lease repair, the GC and the
// periodic sync of this node's keys.
var Cell = cell.Module(
	"etcdstore",
	"Global identities in etcd",

	cell.Config(DefaultConfig),
	cell.Provide(newStore, newDriver, newMirror, newStoreMetrics),
)
