package restoration_test

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
	"github.com/spf13/pflag"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/checkpoint"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/cells/restoration"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/labels"
)

// run starts an agent of local identities on the state directory dir,
// calls use once restoration is done, and stops it.
func run(dir string, use func(context.Context, allocator.Allocator, *restoration.Restorer)) {
	var (
		a allocator.Allocator
		r *restoration.Restorer
	)
	h := hive.New(health.Cell, job.Cell, statedb.Cell, statedir.Cell, allocator.Cell, checkpoint.Cell, ipcache.Cell, restoration.Cell,
		cell.Invoke(func(x allocator.Allocator, y *restoration.Restorer) { a, r = x, y }))
	fs := pflag.NewFlagSet("agent", pflag.ContinueOnError)
	h.RegisterFlags(fs)
	fs.Set("state-dir", dir)
	fs.Set("ipcache-map", "file")
	log := slog.New(slog.DiscardHandler)
	ctx := context.Background()
	if err := h.Start(log, ctx); err != nil {
		panic(err)
	}
	<-r.Done()
	use(ctx, a, r)
	if err := h.Stop(log, ctx); err != nil {
		panic(err)
	}
}

// A local identity keeps its number across a restart: the stop writes the
// checkpoint, the next start restores every identity in it with its old
// number and holds it for the grace period, until a user takes it up again.
func Example() {
	dir, err := os.MkdirTemp("", "restoration-example")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)
	cidr := labels.FromPrefix(netip.MustParsePrefix("10.0.0.0/8"), false)

	run(dir, func(ctx context.Context, a allocator.Allocator, r *restoration.Restorer) {
		// The first start finds no checkpoint.
		fmt.Println("first start restored:", r.Counters().Restored)
		id, _, err := a.Allocate(ctx, cidr)
		if err != nil {
			panic(err)
		}
		fmt.Println("allocated", id.ID)
	})
	run(dir, func(ctx context.Context, a allocator.Allocator, r *restoration.Restorer) {
		fmt.Println("second start restored:", r.Counters().Restored, "held:", len(r.Held()))
		fmt.Println("grace period:", r.GracePeriod())
		id, _, err := a.Allocate(ctx, cidr)
		if err != nil {
			panic(err)
		}
		fmt.Println("allocated", id.ID)
	})
	// Output:
	// first start restored: 0
	// allocated 16777217
	// second start restored: 1 held: 1
	// grace period: 30s
	// allocated 16777217
}
