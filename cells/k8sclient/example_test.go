package k8sclient_test

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/spf13/pflag"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/identityd/identityd/cells/k8sclient"
	"github.com/identityd/identityd/internal/exampletb"
	"github.com/identityd/identityd/internal/k8stest"
	"github.com/identityd/identityd/testenv"
)

// With --k8s-kubeconfig-path the client talks to that file's API server:
// its start waits for the server's /readyz and checks the credentials on
// /version. Clients built from RESTConfig share its rate limit and
// metrics.
func Example() {
	// In a test, t is its *testing.T: the API server stops when it ends.
	t := exampletb.New("Example")
	defer t.Finish()
	api := testenv.StartAPIServer(t)

	var c *k8sclient.Client
	h := hive.New(job.Cell, k8sclient.Cell, cell.Invoke(func(x *k8sclient.Client) { c = x }))
	fs := pflag.NewFlagSet("agent", pflag.ContinueOnError)
	h.RegisterFlags(fs)
	fs.Set("k8s-kubeconfig-path", api.KubeconfigPath())
	log := slog.New(slog.DiscardHandler)
	ctx := context.Background()
	if err := h.Start(log, ctx); err != nil {
		t.Fatal(err)
	}
	defer h.Stop(log, ctx)

	st := c.Status(ctx)
	fmt.Println("connected:", st.Connected, "server:", st.Server == api.URL(), "version known:", st.Version != "")

	var groups metav1.APIGroupList
	if err := k8stest.GetJSON(ctx, c.RESTConfig(), "/apis", &groups); err != nil {
		t.Fatal(err)
	}
	served := map[string]bool{}
	for _, g := range groups.Groups {
		served[g.Name] = true
	}
	for _, g := range []string{"coordination.k8s.io", "cilium.io", "identityd.io"} {
		fmt.Println(g, served[g])
	}
	// Output:
	// connected: true server: true version known: true
	// coordination.k8s.io true
	// cilium.io true
	// identityd.io true
}
