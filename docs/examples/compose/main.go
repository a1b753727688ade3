// Command compose shows how an agent outside the identityd module composes
// identityd's cells into its own hive and uses the identity model: it runs
// the allocator on an embedded etcd with the checkpoint, the ipcache,
// restoration, metrics and health as the identityd binary does, allocates a
// CIDR and a global identity at start, and prints every identity change it
// is told of. Once started, it calls every method of the cells' API that
// returns a value and keeps the value in a variable of its type (tour),
// which shows that another module can name each of these types. Its
// configuration is the cells' flags
// (compose --state-dir DIR --prometheus-serve-addr 127.0.0.1:9981 ...) or
// COMPOSE_-prefixed environment variables.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/clustermesh"
	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/cells/checkpoint"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/cells/k8sclient"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/cells/restoration"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// myAgent is the importing agent's own cell. It depends on the restorer, so
// its start hook runs after restoration gave old identities their numbers.
var myAgent = cell.Module(
	"my-agent",
	"An agent that uses identityd",

	// A handler may depend on the Allocator (here to look up an
	// identity's labels); it is told of every change in batches.
	cell.Provide(func(a allocator.Allocator) allocator.HandlerOut {
		return allocator.NewHandler(allocator.HandlerFunc(func(added, deleted allocator.IdentityMap) {
			for id := range added {
				if ident := a.LookupByID(id); ident != nil {
					fmt.Printf("added %d %s\n", id, ident.Labels)
				}
			}
			for id := range deleted {
				fmt.Printf("deleted %d\n", id)
			}
		}))
	}),
	cell.Invoke(func(lc cell.Lifecycle, a allocator.Allocator, ipc *ipcache.IPCache, _ *restoration.Restorer) {
		// The ipcache prunes the datapath map's entries nobody owns only
		// once every initializer is done: this owner holds it back until
		// its own prefixes are in, as restoration does for the old ones.
		var prefixesIn func() = ipc.RegisterInitializer("my-agent")
		lc.Append(cell.Hook{OnStart: func(ctx cell.HookContext) error {
			defer prefixesIn()
			prefix := netip.MustParsePrefix("10.0.0.0/8")
			var lbls labels.Labels = labels.FromPrefix(prefix, false)
			var id *identity.Identity
			id, _, err := a.Allocate(ctx, lbls)
			if err != nil {
				return err
			}
			var nid identity.NumericIdentity = id.ID
			fmt.Printf("%s has identity %d (scope %s)\n", prefix, nid, nid.Scope())
			web := labels.MustParse("k8s:app=web", "k8s:io.kubernetes.pod.namespace=default")
			if id, _, err = a.Allocate(ctx, web); err != nil {
				return err
			}
			fmt.Printf("%s has global identity %d\n", web, id.ID)
			return ipc.Upsert(ctx, "my-agent", netip.MustParsePrefix("192.168.0.0/16"), ipcache.Info{})
		}})
		// No OnStop that releases identities or removes prefixes: the
		// final checkpoint and the datapath map are what the next start
		// restores, so releasing on the way down would give every local
		// identity a new number after the restart.
	}),
)

func main() {
	opts := hive.DefaultOptions()
	// Flags can also be set as COMPOSE_<FLAG> variables; without a prefix
	// hive would read NODE_NAME, STATE_DIR and the like.
	opts.EnvPrefix = "COMPOSE_"
	// Each module reports health in its own scope, so that /healthz and
	// the health command name the module at fault.
	opts.ModuleDecorators = health.ModuleDecorators
	// Hooks slower than this are logged at info level, the others at
	// debug.
	opts.LogThreshold = 100 * time.Millisecond
	var cells api
	h := hive.NewWithOptions(opts,
		health.Cell,
		metrics.Cell, // each cell below contributes its own collectors
		job.Cell,
		statedb.Cell,
		statedir.Cell,
		kvstore.Cell,
		k8sclient.Cell,
		allocator.Cell,
		etcdstore.Cell,
		crdstore.Cell,
		clustermesh.Cell,
		checkpoint.Cell,
		ipcache.Cell,
		restoration.Cell,
		myAgent,
		// Restoration's automatic grace period follows the kvstore mode,
		// as in the identityd binary; without this provider it is
		// restoration.EmbeddedGracePeriod. In crd mode the store is
		// shared and the client may be nil.
		cell.Provide(func(mode identity.AllocationMode, c *kvstore.Client) restoration.AutomaticGracePeriod {
			return restoration.AutomaticGracePeriodFor(mode.UsesCRD() || !c.Embedded())
		}),
		cell.Invoke(func(a api) { cells = a }),
	)

	flags := pflag.NewFlagSet("compose", pflag.ExitOnError)
	h.RegisterFlags(flags)
	// Defaults for a run without root or a free metrics port; the command
	// line overrides them.
	dir, err := os.MkdirTemp("", "compose-example")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer os.RemoveAll(dir)
	for name, value := range map[string]string{"state-dir": dir, "ipcache-map": "file", "prometheus-serve-addr": ""} {
		if err := flags.Set(name, value); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
	flags.Parse(os.Args[1:])

	// A long-running agent calls h.Run(log), which stops on SIGINT or
	// SIGTERM; the example starts and stops once.
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	if err := h.Start(log, context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	err = tour(ctx, cells)
	cancel()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
	}
	if err := h.Stop(log, context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

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
	var started <-chan struct{} = c.Restorer.Started()
	<-started
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
	var journalDamage *ipcache.MapJournalDamage = c.IPCache.JournalDamage() // nil: the map's journal was sound
	var removed int
	if removed, err = c.IPCache.RemoveOwner(ctx, "nobody"); err != nil {
		return err
	}
	fmt.Printf("ipcache: %s is %d; %d rows (%d mine, table %s), initialized %v, %d map entries (%s), snapshot %d, removed %d, journal damaged %v\n",
		row.Prefix, row.Identity, len(rows), len(mine), table.Name(), initialized, len(mapEntries), kind, len(snapshot), removed, journalDamage != nil)

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
	var granted bool = c.KVStore.Granted(lease)
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
	_, _, _, _, _, _ = lost, granted, stopping, etcd, reqCtx, stopCtx

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
