// Command compose shows how an agent outside the identityd module composes
// identityd's cells into its own hive and uses the identity model: it runs
// the allocator on an embedded etcd with the checkpoint, the ipcache and
// restoration, allocates a CIDR and a global identity at start, and prints
// every identity change it is told of.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"os"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

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

// myAgent is the importing agent's own cell. It depends on the restorer, so
// its start hook runs after restoration gave old identities their numbers.
var myAgent = cell.Module(
	"my-agent",
	"An agent that uses identityd",

	cell.Provide(func() allocator.HandlerOut {
		return allocator.NewHandler(allocator.HandlerFunc(func(added, deleted allocator.IdentityMap) {
			for id, lbls := range added {
				fmt.Printf("added %d %s\n", id, lbls)
			}
			for id := range deleted {
				fmt.Printf("deleted %d\n", id)
			}
		}))
	}),
	cell.Invoke(func(lc cell.Lifecycle, a allocator.Allocator, ipc *ipcache.IPCache, _ *restoration.Restorer) {
		lc.Append(cell.Hook{OnStart: func(ctx cell.HookContext) error {
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
	}),
)

func main() {
	h := hive.New(
		health.Cell,
		job.Cell,
		statedb.Cell,
		statedir.Cell,
		metrics.Cell,
		kvstore.Cell,
		allocator.Cell,
		checkpoint.Cell,
		ipcache.Cell,
		restoration.Cell,
		myAgent,
	)
	dir, err := os.MkdirTemp("", "compose-example")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer os.RemoveAll(dir)
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(h, func(c *ipcache.Config) { c.IPCacheMap = "file" })
	hive.AddConfigOverride(h, func(c *metrics.Config) { c.PrometheusServeAddr = "" })
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	if err := h.Start(log, context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if err := h.Stop(log, context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
