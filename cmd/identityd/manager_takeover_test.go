package main

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	coordinationv1client "k8s.io/client-go/kubernetes/typed/coordination/v1"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"

	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/internal/k8stest"
)

// TestManagerTakeover: two `identityd manager` replicas and an agent in
// operator mode, crd mode. The replica holding the Lease is killed with
// SIGKILL half way through the creation of 200 pods of 40 label sets: the
// other takes the Lease within the lease duration and the retries, every
// pod gets its identity within that takeover and 5 s after the last
// creation, and no label set has two CiliumIdentity objects. It runs in
// make test-long (MANAGER_TAKEOVER=1).
func TestManagerTakeover(t *testing.T) {
	parallelProcess(t)
	if testing.Short() || os.Getenv("MANAGER_TAKEOVER") == "" {
		t.Skip("runs an API server, two managers and an agent: make test-long (MANAGER_TAKEOVER=1)")
	}
	srv := k8stest.Start(t)
	ctx := t.Context()
	core, err := corev1client.NewForConfig(srv.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	coord, err := coordinationv1client.NewForConfig(srv.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(srv.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := core.Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	store := []string{"--identity-allocation-mode=crd", "--k8s-kubeconfig-path", srv.Kubeconfig(), "--identity-gc-cilium-agents=false"}
	const lease, retry = 4 * time.Second, 500 * time.Millisecond
	election := []string{"--identity-manager-lease-namespace", "default", "--leader-election-lease-duration", lease.String(),
		"--leader-election-renew-deadline", "3s", "--leader-election-retry-period", retry.String()}
	managers := map[string]*healthAgent{}
	for _, name := range []string{"manager-0", "manager-1"} {
		managers[name] = startManager(t, filepath.Join(t.TempDir(), name), append(append(slices.Clone(store), "--node-name", name, "--identity-management-mode", "operator"), election...)...)
	}
	agent := startHealthAgentIn(t, filepath.Join(t.TempDir(), "node-0"), append(slices.Clone(store),
		"--node-name", "node-0", "--identity-management-mode", "operator")...)
	agent.waitFor("/readyz", http.StatusOK, 90*time.Second)

	holder := func() string {
		l, err := coord.Leases("default").Get(ctx, "identityd-manager-0", metav1.GetOptions{})
		if err != nil || l.Spec.HolderIdentity == nil {
			return ""
		}
		node, _, _ := strings.Cut(*l.Spec.HolderIdentity, "_")
		return node
	}
	var leader string
	waitUntil(t, 30*time.Second, "a manager holds the Lease", func() error {
		if leader = holder(); managers[leader] == nil {
			return fmt.Errorf("holder %q", leader)
		}
		return nil
	})

	var pods []workloadPod
	for i := range 200 {
		pods = append(pods, workloadPod{ns: "shop", name: fmt.Sprintf("p-%d", i), node: "node-0",
			app: fmt.Sprintf("app-%d", i%40), ips: []string{fmt.Sprintf("10.5.%d.%d", i/200, i%200+1)}})
	}
	none := func(workloadPod) bool { return false }
	createPods(t, core, pods[:100], none)
	killed := time.Now()
	if err := managers[leader].cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	createPods(t, core, pods[100:], none)
	created := time.Now()
	var takeover time.Duration
	waitUntil(t, lease+10*time.Second, "the other manager takes the Lease", func() error {
		if h := holder(); h == leader || managers[h] == nil {
			return fmt.Errorf("holder %q", h)
		}
		takeover = time.Since(killed)
		return nil
	})
	t.Logf("the Lease changed hands %s after the SIGKILL of %s", takeover.Round(10*time.Millisecond), leader)
	if bound := lease + 4*retry + 2*time.Second; takeover > bound {
		t.Errorf("the takeover took %s, more than the lease and the retries (%s)", takeover, bound)
	}
	ids := waitPodsReady(t, agent, pods, 2*time.Minute)
	ready := time.Since(created)
	t.Logf("every pod held its identity %s after the last creation", ready.Round(10*time.Millisecond))
	if ready > takeover+5*time.Second {
		t.Errorf("the last pod held its identity %s after the last creation, more than the takeover (%s) and 5 s", ready, takeover)
	}
	expectOneIDPerLabelSet(t, pods, ids)
	list, err := dyn.Resource(crdstore.CiliumIdentityResource).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if n := len(list.Items); n != 40 {
		t.Errorf("%d CiliumIdentity objects for 40 label sets", n)
	}
}
