package k8sclient_test

import (
	"bufio"
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/script"
	"github.com/cilium/hive/script/scripttest"

	"github.com/identityd/identityd/cells/k8sclient"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/k8stest"
	"github.com/identityd/identityd/internal/scriptengine"
)

// TestScript runs testdata/*.txtar, each against its own hive in crd mode
// with a real API server of its own; a script whose first line is
// "#! kvstore" runs in kvstore mode, without server and client.
func TestScript(t *testing.T) {
	scripttest.Test(t, context.Background(),
		func(tb testing.TB, args []string) *script.Engine {
			mode := identity.AllocationModeCRD
			if slices.Contains(args, "kvstore") {
				mode = identity.AllocationModeKVStore
			}
			h := hive.New(k8sclient.Cell, cell.Provide(func() identity.AllocationMode { return mode }))
			if mode == identity.AllocationModeCRD {
				srv := k8stest.Start(tb)
				hive.AddConfigOverride(h, func(c *k8sclient.Config) { c.K8sKubeconfigPath = srv.Kubeconfig() })
			}
			return scriptengine.New(tb, h)
		}, nil, "testdata/*.txtar")
}

// TestStatusCommandWithoutClient: k8s/status on a node without a client
// says why there is none.
func TestStatusCommandWithoutClient(t *testing.T) {
	h := hive.New(k8sclient.Cell)
	e := scriptengine.New(t, h)
	s, err := script.NewState(t.Context(), t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	var log strings.Builder
	err = e.Execute(s, "", bufio.NewReader(strings.NewReader("k8s/status\n")), &log)
	want := "no Kubernetes API server is used: the identity allocation mode is not crd and neither --k8s-kubeconfig-path nor --k8s-api-server is set"
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("k8s/status without a client: %v, want %q", err, want)
	}
}
