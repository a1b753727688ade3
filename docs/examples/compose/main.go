// Command compose shows how an agent outside the identityd module composes
// identityd's cells into its own hive and uses the identity model: it runs
// the allocator on an embedded etcd with the checkpoint, the ipcache,
// restoration, metrics and health as the identityd binary does, allocates a
// CIDR and a global identity at start, and prints every identity change it
// is told of. Its configuration is the cells' flags
// (compose --state-dir DIR --prometheus-serve-addr 127.0.0.1:9963 ...) or
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

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/clustermesh"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
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
	h := hive.NewWithOptions(opts,
		health.Cell,
		metrics.Cell, // each cell below contributes its own collectors
		job.Cell,
		statedb.Cell,
		statedir.Cell,
		kvstore.Cell,
		allocator.Cell,
		etcdstore.Cell,
		clustermesh.Cell,
		checkpoint.Cell,
		ipcache.Cell,
		restoration.Cell,
		myAgent,
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
	if err := h.Stop(log, context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
