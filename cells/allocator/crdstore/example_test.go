package crdstore_test

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/cells/k8sclient"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/exampletb"
	"github.com/identityd/identityd/labels"
	"github.com/identityd/identityd/testenv"
)

// startNode runs the allocator in crd mode against the API server of
// kubeconfig, as node name.
func startNode(t *exampletb.TB, kubeconfig, name string) allocator.Allocator {
	var a allocator.Allocator
	h := hive.New(job.Cell, statedb.Cell, k8sclient.Cell, allocator.Cell, crdstore.Cell,
		// kvstore.Cell provides the node name in a full agent.
		cell.Provide(func() identity.NodeName { return identity.NodeName(name) }),
		cell.Invoke(func(x allocator.Allocator) { a = x }))
	fs := pflag.NewFlagSet(name, pflag.ContinueOnError)
	h.RegisterFlags(fs)
	for k, v := range map[string]string{"identity-allocation-mode": "crd", "k8s-kubeconfig-path": kubeconfig} {
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

// Two nodes in crd mode give a label set one identity, a CiliumIdentity
// object as Cilium writes it; each node's uses are its IdentityNode object.
func Example() {
	// In a test, t is its *testing.T: the API server stops when it ends.
	t := exampletb.New("Example")
	defer t.Finish()
	api := testenv.StartAPIServer(t)
	a := startNode(t, api.KubeconfigPath(), "node-a")
	b := startNode(t, api.KubeconfigPath(), "node-b")
	ctx := t.Context()

	web := labels.MustParse("k8s:app=web", "k8s:io.kubernetes.pod.namespace=default")
	idA, _, err := a.Allocate(ctx, web)
	if err != nil {
		t.Fatal(err)
	}
	idB, _, err := b.Allocate(ctx, web)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Println("same identity:", idA.ID == idB.ID)

	dyn, err := dynamic.NewForConfig(api.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	objs, err := dyn.Resource(crdstore.CiliumIdentityResource).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range objs.Items {
		fmt.Println(o.GetKind(), o.GetName() == idA.ID.String(), o.Object["security-labels"])
	}
	// Output:
	// same identity: true
	// CiliumIdentity true map[k8s:app:web k8s:io.kubernetes.pod.namespace:default]
}
