// Command compose shows how an agent outside the identityd module composes
// identityd's cells into its own hive and uses the identity model. It
// allocates a CIDR identity at start and prints every identity change.
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
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// myAgent is the importing agent's own cell: it depends on the allocator
// and handles identity changes.
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
	cell.Invoke(func(lc cell.Lifecycle, a allocator.Allocator) {
		lc.Append(cell.Hook{OnStart: func(ctx cell.HookContext) error {
			lbls := labels.FromPrefix(netip.MustParsePrefix("10.0.0.0/8"), false)
			var id *identity.Identity
			id, _, err := a.Allocate(ctx, lbls)
			if err != nil {
				return err
			}
			var nid identity.NumericIdentity = id.ID
			fmt.Printf("10.0.0.0/8 has identity %d (scope %s)\n", nid, nid.Scope())
			return nil
		}})
	}),
)

func main() {
	h := hive.New(
		job.Cell,
		statedb.Cell,
		statedir.Cell,
		allocator.Cell,
		myAgent,
	)
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = os.TempDir() + "/compose-example" })
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if err := h.Start(log, context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if err := h.Stop(log, context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
