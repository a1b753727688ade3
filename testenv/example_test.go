package testenv_test

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

// A test of an agent in crd mode: the allocator keeps global identities as
// CiliumIdentity objects in a real API server, which the agent finds
// through --k8s-kubeconfig-path, and the test reads them back.
func Example() {
	// In a test, t is its *testing.T: the servers stop when it ends.
	t := exampletb.New("Example")
	defer t.Finish()

	api := testenv.StartAPIServer(t)

	var alloc allocator.Allocator
	h := hive.New(job.Cell, statedb.Cell, k8sclient.Cell, allocator.Cell, crdstore.Cell,
		// kvstore.Cell provides --node-name; this agent has no kvstore.
		cell.Provide(func() identity.NodeName { return "node-a" }),
		cell.Invoke(func(a allocator.Allocator) { alloc = a }))
	flags := pflag.NewFlagSet("agent", pflag.ContinueOnError)
	h.RegisterFlags(flags)
	flags.Set("identity-allocation-mode", "crd")
	flags.Set("k8s-kubeconfig-path", api.KubeconfigPath())

	log := slog.New(slog.DiscardHandler)
	ctx := context.Background()
	if err := h.Start(log, ctx); err != nil {
		t.Fatal(err)
	}
	defer h.Stop(log, ctx)

	id, _, err := alloc.Allocate(ctx, labels.MustParse("k8s:app=web", "k8s:io.kubernetes.pod.namespace=default"))
	if err != nil {
		t.Fatal(err)
	}
	fmt.Println("scope:", id.ID.Scope())

	dyn, err := dynamic.NewForConfig(api.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	obj, err := dyn.Resource(crdstore.CiliumIdentityResource).Get(ctx, id.ID.String(), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	fmt.Println("object:", obj.GetKind(), obj.GetName() == id.ID.String())
	// Output:
	// scope: global
	// object: CiliumIdentity true
}
