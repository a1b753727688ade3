package etcdstore_test

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/internal/exampletb"
	"github.com/identityd/identityd/labels"
	"github.com/identityd/identityd/testenv"
)

// startNode runs the allocator with the etcd store on the etcd at
// endpoint, as node name.
func startNode(t *exampletb.TB, endpoint, name string) allocator.Allocator {
	var a allocator.Allocator
	h := hive.New(job.Cell, statedb.Cell, statedir.Cell, kvstore.Cell, allocator.Cell, etcdstore.Cell,
		cell.Invoke(func(x allocator.Allocator) { a = x }))
	fs := pflag.NewFlagSet(name, pflag.ContinueOnError)
	h.RegisterFlags(fs)
	for k, v := range map[string]string{"state-dir": t.TempDir(), "node-name": name, "kvstore-endpoints": endpoint} {
		if err := fs.Set(k, v); err != nil {
			t.Fatal(err)
		}
	}
	log := slog.New(slog.DiscardHandler)
	if err := h.Start(log, context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Stop(log, context.Background()) })
	return a
}

// Two nodes on one etcd give a label set the same global identity: the
// first creates it (one transaction), the second adopts it. The master key
// has Cilium's layout, so Cilium agents on the same etcd agree.
func Example() {
	// In a test, t is its *testing.T: the etcd stops when it ends.
	t := exampletb.New("Example")
	defer t.Finish()
	etcd := testenv.StartEtcd(t)
	a := startNode(t, etcd.Endpoints()[0], "node-a")
	b := startNode(t, etcd.Endpoints()[0], "node-b")
	ctx := t.Context()

	web := labels.MustParse("k8s:app=web", "k8s:io.kubernetes.pod.namespace=default")
	idA, createdA, err := a.Allocate(ctx, web)
	if err != nil {
		t.Fatal(err)
	}
	idB, createdB, err := b.Allocate(ctx, web)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Println("same identity:", idA.ID == idB.ID, "scope:", idA.ID.Scope())
	fmt.Println("new on node-a:", createdA, "new on node-b:", createdB)

	resp, err := etcd.Client(t).Get(ctx, fmt.Sprintf("cilium/state/identities/v1/id/%d", idA.ID))
	if err != nil {
		t.Fatal(err)
	}
	fmt.Printf("master key value: %s\n", resp.Kvs[0].Value)
	// Output:
	// same identity: true scope: global
	// new on node-a: true new on node-b: false
	// master key value: k8s:app=web;k8s:io.kubernetes.pod.namespace=default;
}
