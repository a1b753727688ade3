package main

import (
	"context"
	"fmt"
	"net/netip"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/checkpoint"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/cells/restoration"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// api holds what the composed cells provide, for tour.
type api struct {
	cell.In

	Allocator  allocator.Allocator
	IPCache    *ipcache.IPCache
	Restorer   *restoration.Restorer
	Checkpoint *checkpoint.Checkpoint
	KVStore    *kvstore.Client
	Dir        *statedir.Dir
	Health     *health.Provider
	Metrics    *metrics.Server
}

// tour calls, once the hive has started, every method of the composed
// cells that returns a value, and keeps each value in a variable of its
// declared type: an agent in another module can name every type of the
// cells' API. Start and Stop hooks, and methods that only return an error
// or change what the agent holds (Release, Withhold, RevokeLease), are left
// out.
func tour(ctx context.Context, c api) error {
	// Restoration: done once its job has put the old prefixes back.
	select {
	case <-c.Restorer.Ready():
	case <-ctx.Done():
		return ctx.Err()
	}
	var done <-chan struct{} = c.Restorer.Done()
	<-done
	var status restoration.Status = c.Restorer.Status()
	var counters restoration.Counters = c.Restorer.Counters()
	var held []identity.Identity = c.Restorer.Held()
	var grace time.Duration = c.Restorer.GracePeriod()
	fmt.Printf("restoration: %s, %d restored, %d held, grace period %s\n", status.State, counters.Restored, len(held), grace)

	// The allocator.
	web := labels.MustParse("k8s:app=web", "k8s:io.kubernetes.pod.namespace=default")
	var results []allocator.Result = c.Allocator.AllocateBatch(ctx, []allocator.Request{{Labels: web}})
	for _, r := range results {
		if r.Err != nil {
			return r.Err
		}
		if _, err := c.Allocator.Release(ctx, r.Identity); err != nil {
			return err
		}
	}
	var byLabels *identity.Identity = c.Allocator.LookupByLabels(web)
	var byID *identity.Identity = c.Allocator.LookupByID(identity.ReservedIdentityWorld)
	var entries []allocator.Entry = c.Allocator.List()
	var local []*identity.Identity = c.Allocator.LocalIdentities()
	var withheld []identity.NumericIdentity = c.Allocator.Withheld()
	fmt.Printf("allocator: %s is %d, %d identities (%d local, %d withheld)\n", byID.Labels, byID.ID, len(entries), len(local), len(withheld))
	_ = byLabels

	// The ipcache.
	prefix := netip.MustParsePrefix("192.168.0.0/16")
	if err := c.IPCache.WaitDurable(ctx, prefix); err != nil {
		return err
	}
	var row *ipcache.Entry
	row, _ = c.IPCache.LookupPrefix(prefix)
	row, _ = c.IPCache.Lookup(netip.MustParseAddr("192.168.1.1"))
	var rows []*ipcache.Entry = c.IPCache.List()
	var mine []*ipcache.Entry = c.IPCache.ListOwner("my-agent")
	var table statedb.Table[*ipcache.Entry] = c.IPCache.Table()
	var initialized bool
	initialized, _ = c.IPCache.Initialized()
	var snapshot []ipcache.MapEntry = c.IPCache.TakeSnapshot() // restoration took it: nil
	dump, err := c.IPCache.MapDump()
	if err != nil {
		return err
	}
	var mapEntries []ipcache.MapEntry = dump
	var kind ipcache.MapKind = c.IPCache.MapKind()
	var removed int
	if removed, err = c.IPCache.RemoveOwner(ctx, "nobody"); err != nil {
		return err
	}
	fmt.Printf("ipcache: %s is %d; %d rows (%d mine, table %s), initialized %v, %d map entries (%s), snapshot %d, removed %d\n",
		row.Prefix, row.Identity, len(rows), len(mine), table.Name(), initialized, len(mapEntries), kind, len(snapshot), removed)

	// The checkpoint.
	written, err := c.Checkpoint.Write()
	if err != nil {
		return err
	}
	var cpStatus checkpoint.Status = c.Checkpoint.Status()
	loaded, err := c.Checkpoint.Load()
	if err != nil {
		return err
	}
	var result checkpoint.LoadResult = loaded
	var path string = c.Checkpoint.Path()
	fmt.Printf("checkpoint: %s, %d identities loaded, %d written\n", path, len(result.Identities), written.Entries)
	_ = cpStatus

	// The kvstore client.
	var kvStatus kvstore.Status = c.KVStore.Status(ctx)
	var lease clientv3.LeaseID
	if lease, err = c.KVStore.Lease(ctx); err != nil {
		return err
	}
	var lost <-chan struct{} = c.KVStore.LeaseLost(lease)
	var stopping <-chan struct{} = c.KVStore.Stopping()
	var etcd *clientv3.Client = c.KVStore.Client()
	reqCtx, cancel := c.KVStore.RequestContext(ctx)
	cancel()
	stopCtx, cancel := c.KVStore.StopContext(ctx)
	cancel()
	var counts map[string]uint64 = c.KVStore.RequestCounts()
	var endpoints []string = c.KVStore.Endpoints()
	fmt.Printf("kvstore: node %s, embedded %v, %d endpoints, lease TTL %s, request timeout %s, %d request kinds\n%s",
		c.KVStore.NodeName(), c.KVStore.Embedded(), len(endpoints), c.KVStore.LeaseTTL(), c.KVStore.RequestTimeout(), len(counts), kvstore.FormatStatus(kvStatus))
	_, _, _, _, _ = lost, stopping, etcd, reqCtx, stopCtx

	// The state directory, health and metrics.
	var dir string = c.Dir.Path()
	var file string = c.Dir.Join("example")
	var all []health.Status = c.Health.All()
	healthy, _ := c.Health.Healthy()
	live, _ := c.Health.Live()
	var root cell.Health = c.Health.Root()
	var addr string = c.Metrics.Addr()
	fmt.Printf("state in %s (%s); %d health scopes, healthy %v, live %v; metrics on %q\n", dir, file, len(all), healthy, live, addr)
	_ = root
	return nil
}
