// Package scrape derives identityd's state metrics at scrape time from the
// public APIs of the allocator (and its etcd backend), checkpoint, kvstore,
// ipcache and restoration cells. Every
// dependency is optional: a hive without the ipcache simply has no ipcache
// metrics, and none of those cells has to know about metrics.
//
// It is a package of its own, not part of cells/metrics, because cells
// import cells/metrics to contribute their collectors; cells/metrics
// importing them back would be a cycle.
package scrape

import (
	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/checkpoint"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/cells/restoration"
)

// Cell contributes the scrape-time collectors to the metrics registry. Use
// it together with metrics.Cell.
var Cell = cell.Module(
	"metrics-scrape",
	"Metrics derived from the cells state at scrape time",

	cell.Provide(
		identityCollectorOut,
		checkpointCollectorOut,
		kvstoreCollectorOut,
		ipcacheCollectorOut,
		gcCollectorOut,
		nodeCollectorOut,
		restorationCollectorOut,
	),
)

type identityParams struct {
	cell.In

	Allocator allocator.Allocator `optional:"true"`
	// Config gives this cluster's global ID range; its zero value (no
	// allocator config in the hive) is cluster 0 of 255.
	Config allocator.Config `optional:"true"`
}

// The collectors are only contributed when what they read exists: a nil
// Collector is skipped by the registry.

func identityCollectorOut(p identityParams) metrics.CollectorOut {
	if p.Allocator == nil {
		return metrics.CollectorOut{}
	}
	return metrics.NewCollector(NewIdentityCollector(p.Allocator, p.Config.ClusterInfo()))
}

type checkpointParams struct {
	cell.In

	Checkpoint *checkpoint.Checkpoint `optional:"true"`
}

func checkpointCollectorOut(p checkpointParams) metrics.CollectorOut {
	if p.Checkpoint == nil {
		return metrics.CollectorOut{}
	}
	return metrics.NewCollector(NewCheckpointCollector(p.Checkpoint))
}

type kvstoreParams struct {
	cell.In

	Lifecycle cell.Lifecycle
	Client    *kvstore.Client `optional:"true"`
}

func kvstoreCollectorOut(p kvstoreParams) metrics.CollectorOut {
	if p.Client == nil {
		return metrics.CollectorOut{}
	}
	c := NewKVStoreCollector(p.Client)
	p.Lifecycle.Append(c)
	return metrics.NewCollector(c)
}

type ipcacheParams struct {
	cell.In

	DB      *statedb.DB      `optional:"true"`
	IPCache *ipcache.IPCache `optional:"true"`
}

func ipcacheCollectorOut(p ipcacheParams) metrics.CollectorOut {
	if p.DB == nil || p.IPCache == nil {
		return metrics.CollectorOut{}
	}
	return metrics.NewCollector(NewIPCacheCollector(p.DB, p.IPCache.Table()))
}

type gcParams struct {
	cell.In

	Backend globalstore.Backend `optional:"true"`
}

// gcCollectorOut reports the GC only of a backend that has one (the etcd
// backend); the allocator cell provides a nil backend without a kvstore.
func gcCollectorOut(p gcParams) metrics.CollectorOut {
	b, ok := p.Backend.(GCStatser)
	if !ok {
		return metrics.CollectorOut{}
	}
	return metrics.NewCollector(NewGCCollector(b))
}

// nodeCollectorOut reports the checks of this node's keys only of a
// backend that makes them (the etcd backend).
func nodeCollectorOut(p gcParams) metrics.CollectorOut {
	b, ok := p.Backend.(NodeStatser)
	if !ok {
		return metrics.CollectorOut{}
	}
	return metrics.NewCollector(NewNodeCollector(b))
}

type restorationParams struct {
	cell.In

	Restorer *restoration.Restorer `optional:"true"`
}

func restorationCollectorOut(p restorationParams) metrics.CollectorOut {
	if p.Restorer == nil {
		return metrics.CollectorOut{}
	}
	return metrics.NewCollector(NewRestorationCollector(p.Restorer))
}
