package kvstore_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/spf13/pflag"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/internal/exampletb"
	"github.com/identityd/identityd/testenv"
)

// startClient runs a hive of the kvstore cell (and the state directory it
// keeps the embedded etcd in) with the given flags, and returns its client
// and the hive's stop.
func startClient(flags map[string]string) (*kvstore.Client, func()) {
	var c *kvstore.Client
	h := hive.New(job.Cell, statedir.Cell, kvstore.Cell,
		cell.Invoke(func(x *kvstore.Client) { c = x }))
	fs := pflag.NewFlagSet("example", pflag.ContinueOnError)
	h.RegisterFlags(fs)
	dir, err := os.MkdirTemp("", "kvstore-example")
	if err != nil {
		panic(err)
	}
	flags["state-dir"] = dir
	flags["node-name"] = "node-a"
	for k, v := range flags {
		if err := fs.Set(k, v); err != nil {
			panic(err)
		}
	}
	log := slog.New(slog.DiscardHandler)
	if err := h.Start(log, context.Background()); err != nil {
		panic(err)
	}
	return c, func() {
		h.Stop(log, context.Background())
		os.RemoveAll(dir)
	}
}

// Without --kvstore-endpoints the cell runs an embedded etcd in the state
// directory. Keys written with the node's lease vanish when the node stops.
func Example_embedded() {
	c, stop := startClient(map[string]string{})
	defer stop()
	ctx := context.Background()

	lease, err := c.Lease(ctx)
	if err != nil {
		panic(err)
	}
	reqCtx, cancel := c.RequestContext(ctx)
	defer cancel()
	if _, err := c.Client().Put(reqCtx, "example/node-a", "up", clientv3.WithLease(lease)); err != nil {
		panic(err)
	}
	resp, err := c.Client().Get(reqCtx, "example/node-a")
	if err != nil {
		panic(err)
	}
	fmt.Println("embedded:", c.Embedded(), "node:", c.NodeName())
	fmt.Printf("%s=%s\n", resp.Kvs[0].Key, resp.Kvs[0].Value)
	fmt.Println("puts counted:", c.RequestCounts()["Put"] > 0)
	// Output:
	// embedded: true node: node-a
	// example/node-a=up
	// puts counted: true
}

// With --kvstore-endpoints the cell is a client of that etcd; in a test it
// is the real etcd of package testenv.
func Example_external() {
	// In a test, t is its *testing.T: the etcd stops when it ends.
	t := exampletb.New("Example_external")
	defer t.Finish()
	etcd := testenv.StartEtcd(t)

	c, stop := startClient(map[string]string{"kvstore-endpoints": strings.Join(etcd.Endpoints(), ",")})
	defer stop()
	status := c.Status(context.Background())
	fmt.Println("embedded:", c.Embedded(), "mode:", status.Mode(), "connected:", status.Connected(), "of", len(status.Endpoints))
	// Output:
	// embedded: false mode: external connected: 1 of 1
}
