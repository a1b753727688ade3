package clustermesh_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/clustermesh"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/exampletb"
	"github.com/identityd/identityd/labels"
	"github.com/identityd/identityd/testenv"
)

// startNode runs an allocator with the etcd store and the cluster mesh,
// with the given flags.
func startNode(t *exampletb.TB, flags map[string]string) allocator.Allocator {
	var a allocator.Allocator
	h := hive.New(job.Cell, statedb.Cell, statedir.Cell, kvstore.Cell, allocator.Cell, etcdstore.Cell, clustermesh.Cell,
		cell.Invoke(func(x allocator.Allocator) { a = x }))
	fs := pflag.NewFlagSet("node", pflag.ContinueOnError)
	h.RegisterFlags(fs)
	flags["state-dir"] = t.TempDir()
	for k, v := range flags {
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

// A node of cluster east sees the identities of cluster west, read from
// west's etcd, once a file named west in --clustermesh-config gives its
// endpoints and cluster ID.
func Example() {
	// In a test, t is its *testing.T: the etcds stop when it ends.
	t := exampletb.New("Example")
	defer t.Finish()

	westEtcd := testenv.StartEtcd(t)
	west := startNode(t, map[string]string{
		"cluster-name": "west", "cluster-id": "2", "node-name": "west-1",
		"kvstore-endpoints": westEtcd.Endpoints()[0],
	})
	db := labels.MustParse("k8s:app=db", "k8s:io.cilium.k8s.policy.cluster=west", "k8s:io.kubernetes.pod.namespace=default")
	remote, _, err := west.Allocate(t.Context(), db)
	if err != nil {
		t.Fatal(err)
	}

	meshDir := t.TempDir()
	file := fmt.Sprintf("endpoints:\n  - %s\ncluster-id: 2\n", westEtcd.Endpoints()[0])
	if err := os.WriteFile(filepath.Join(meshDir, "west"), []byte(file), 0o600); err != nil {
		t.Fatal(err)
	}
	east := startNode(t, map[string]string{
		"cluster-name": "east", "cluster-id": "1", "node-name": "east-1",
		"kvstore-endpoints":  testenv.StartEtcd(t).Endpoints()[0],
		"clustermesh-config": meshDir,
	})

	// The mesh connects in the background.
	var seen *identity.Identity
	for deadline := time.Now().Add(30 * time.Second); seen == nil && time.Now().Before(deadline); {
		seen = east.LookupByID(remote.ID)
		time.Sleep(20 * time.Millisecond)
	}
	if seen == nil {
		t.Fatalf("east does not see west's identity %d", remote.ID)
	}
	fmt.Println("cluster of the ID:", identity.ClusterID(seen.ID, 255))
	fmt.Println(seen.Labels)
	// Output:
	// cluster of the ID: 2
	// k8s:app=db,k8s:io.cilium.k8s.policy.cluster=west,k8s:io.kubernetes.pod.namespace=default
}
