package ipcache_test

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
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/cells/statedir"
)

// An owner upserts a prefix with no metadata of its own: the prefix gets
// its CIDR label set and a node-local identity for it. WaitDurable returns
// once the pair is in the datapath map (here the file backend, in a
// temporary state directory), where MapDump reads it back.
func ExampleIPCache_Upsert() {
	dir, err := os.MkdirTemp("", "ipcache-example")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer os.RemoveAll(dir)

	var ipc *ipcache.IPCache
	h := hive.New(
		cell.SimpleHealthCell, job.Cell, statedb.Cell, statedir.Cell,
		allocator.Cell, ipcache.Cell,
		cell.Invoke(func(c *ipcache.IPCache) { ipc = c }),
	)
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(h, func(c *ipcache.Config) { c.IPCacheMap = string(ipcache.MapKindFile) })
	log := slog.New(slog.DiscardHandler)
	ctx := context.Background()
	if err := h.Start(log, ctx); err != nil {
		fmt.Println(err)
		return
	}
	defer h.Stop(log, ctx)

	prefix := netip.MustParsePrefix("10.0.0.0/8")
	if err := ipc.Upsert(ctx, "my-agent", prefix, ipcache.Info{}); err != nil {
		fmt.Println(err)
		return
	}
	if err := ipc.WaitDurable(ctx, prefix); err != nil {
		fmt.Println(err)
		return
	}
	e, _ := ipc.Lookup(netip.MustParseAddr("10.1.2.3"))
	fmt.Println("lookup:", e.Prefix, e.Identity, e.Labels, e.Source)

	dump, err := ipc.MapDump()
	if err != nil {
		fmt.Println(err)
		return
	}
	var entry ipcache.MapEntry = dump[0]
	fmt.Println("map:", ipc.MapKind(), entry.Key, entry.Value.Identity)
	// Output:
	// lookup: 10.0.0.0/8 16777217 cidr:10.0.0.0/8,reserved:world metadata
	// map: file 10.0.0.0/8 16777217
}
