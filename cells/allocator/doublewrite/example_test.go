package doublewrite_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/cells/allocator/doublewrite"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/cells/k8sclient"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/internal/exampletb"
	"github.com/identityd/identityd/labels"
	"github.com/identityd/identityd/testenv"
)

// In doublewrite-readkvstore mode etcd decides the identity of a label
// set, and the node writes the same ID to the API server as a
// CiliumIdentity: the first step of a move from etcd to CRDs.
func Example() {
	// In a test, t is its *testing.T: the servers stop when it ends.
	t := exampletb.New("Example")
	defer t.Finish()
	etcd := testenv.StartEtcd(t)
	api := testenv.StartAPIServer(t)
	stateDir, err := os.MkdirTemp("", "doublewrite-example")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(stateDir) })

	var a allocator.Allocator
	h := hive.New(job.Cell, statedb.Cell, statedir.Cell, kvstore.Cell, k8sclient.Cell,
		allocator.Cell, etcdstore.Cell, crdstore.Cell, doublewrite.Cell,
		cell.Invoke(func(x allocator.Allocator) { a = x }))
	fs := pflag.NewFlagSet("agent", pflag.ContinueOnError)
	h.RegisterFlags(fs)
	for k, v := range map[string]string{
		"identity-allocation-mode": "doublewrite-readkvstore",
		"kvstore-endpoints":        etcd.Endpoints()[0],
		"k8s-kubeconfig-path":      api.KubeconfigPath(),
		"state-dir":                stateDir,
		"node-name":                "node-a",
	} {
		if err := fs.Set(k, v); err != nil {
			t.Fatal(err)
		}
	}
	log := slog.New(slog.DiscardHandler)
	ctx := context.Background()
	if err := h.Start(log, ctx); err != nil {
		t.Fatal(err)
	}
	defer h.Stop(log, ctx)

	web := labels.MustParse("k8s:app=web", "k8s:io.kubernetes.pod.namespace=default")
	id, _, err := a.Allocate(ctx, web)
	if err != nil {
		t.Fatal(err)
	}

	// The master key in etcd, which decided the ID.
	resp, err := etcd.Client(t).Get(ctx, etcdstore.MasterKeyPrefix+id.ID.String())
	if err != nil {
		t.Fatal(err)
	}
	fmt.Println("etcd:", len(resp.Kvs) == 1 && string(resp.Kvs[0].Value) != "")

	// The same ID as a CiliumIdentity object.
	dyn, err := dynamic.NewForConfig(api.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	obj, err := dyn.Resource(crdstore.CiliumIdentityResource).Get(ctx, id.ID.String(), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	fmt.Println("crd:", obj.GetName() == id.ID.String(), obj.Object["security-labels"])
	// Output:
	// etcd: true
	// crd: true map[k8s:app:web k8s:io.kubernetes.pod.namespace:default]
}
