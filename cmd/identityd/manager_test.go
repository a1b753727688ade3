package main

import (
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"

	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/k8stest"
)

// startManager starts `identityd manager` with args, its metrics on a port
// the kernel chooses, stopped at the test's end.
func startManager(t *testing.T, dir string, args ...string) *healthAgent {
	t.Helper()
	return startWrappedAgent(t, dir, func(c *exec.Cmd) {
		// The agent's flags the manager does not have go.
		argv := []string{c.Args[0], "manager"}
		for i := 1; i < len(c.Args); i++ {
			if c.Args[i] == "--ipcache-map" {
				i++
				continue
			}
			argv = append(argv, c.Args[i])
		}
		c.Args = argv
	}, args...)
}

// TestOperatorModeManager: on a real kube-apiserver in crd mode, an agent
// with --identity-management-mode=operator and then one `identityd
// manager` (see operatorModeManager).
func TestOperatorModeManager(t *testing.T) {
	parallelProcess(t)
	if testing.Short() {
		t.Skip("runs an API server, the manager and an agent")
	}
	srv := k8stest.Start(t)
	dyn, err := dynamic.NewForConfig(srv.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	store := []string{"--identity-allocation-mode=crd", "--k8s-kubeconfig-path", srv.Kubeconfig(), "--identity-gc-cilium-agents=false"}
	a, m := operatorModeManager(t, srv, store, func() (int, error) {
		list, err := dyn.Resource(crdstore.CiliumIdentityResource).List(t.Context(), metav1.ListOptions{})
		if err != nil {
			return 0, err
		}
		return len(list.Items), nil
	})
	const created = `identityd_crd_allocations_total{outcome="created"}`
	if got, ok := a.metricValue(created); !ok || got != 0 {
		t.Errorf("the agent in operator mode: %s = %g (found %t), want 0", created, got, ok)
	}
	if got, ok := m.metricValue(created); !ok || got != 9 {
		t.Errorf("the manager: %s = %g (found %t), want 9", created, got, ok)
	}
}

// TestOperatorModeManagerKVStore is TestOperatorModeManager in kvstore mode:
// the identities in an external etcd, the pods read from the API server of
// --k8s-kubeconfig-path. It runs in make test-long (MANAGER_KVSTORE=1).
func TestOperatorModeManagerKVStore(t *testing.T) {
	parallelProcess(t)
	if testing.Short() || os.Getenv("MANAGER_KVSTORE") == "" {
		t.Skip("runs an API server, etcd, the manager and an agent: make test-long (MANAGER_KVSTORE=1)")
	}
	srv := k8stest.Start(t)
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := etcd.Client(t)
	store := []string{"--kvstore-endpoints", strings.Join(etcd.Endpoints(), ","), "--k8s-kubeconfig-path", srv.Kubeconfig()}
	operatorModeManager(t, srv, store, func() (int, error) {
		resp, err := cli.Get(t.Context(), etcdstore.MasterKeyPrefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			return 0, err
		}
		return int(resp.Count), nil
	})
}

// operatorModeManager: an agent with --identity-management-mode=operator
// and the store flags store, and 30 pods of 6 label sets on its node and
// 6 of 3 more on a node without an agent. Until a manager runs, the
// agent's pods wait ("waiting for the identity manager") and the store
// holds no identity (identities counts them at the server): the agent
// creates none. Then `identityd manager` creates one identity per label
// set of the cluster's pods, on any node: the agent's pods hold them with
// their IPs in its map, pods of equal labels share one, and the store
// holds 9 identities, no label set twice. It returns the agent and the
// manager.
func operatorModeManager(t *testing.T, srv *k8stest.Server, store []string, identities func() (int, error)) (agent, manager *healthAgent) {
	ctx := t.Context()
	core, err := corev1client.NewForConfig(srv.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := core.Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop",
		Labels: map[string]string{"team": "t0"}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	agent = startHealthAgentIn(t, filepath.Join(t.TempDir(), "node-0"), append(slices.Clone(store),
		"--node-name", "node-0", "--identity-management-mode", "operator", "--identity-change-grace-period", workloadsGrace.String())...)
	agent.waitFor("/readyz", http.StatusOK, 90*time.Second)

	var pods, others []workloadPod
	for i := range 30 {
		pods = append(pods, workloadPod{ns: "shop", name: fmt.Sprintf("p-%d", i), node: "node-0",
			app: fmt.Sprintf("app-%d", i%6), ips: []string{fmt.Sprintf("10.3.0.%d", i+1)}})
	}
	for i := range 6 {
		others = append(others, workloadPod{ns: "shop", name: fmt.Sprintf("q-%d", i), node: "node-1",
			app: fmt.Sprintf("other-%d", i%3), ips: []string{fmt.Sprintf("10.4.0.%d", i+1)}})
	}
	createPods(t, core, append(slices.Clone(pods), others...), func(workloadPod) bool { return false })
	waitPodsWaiting(t, agent, len(pods))
	if n, err := identities(); err != nil || n != 0 {
		t.Fatalf("before any manager runs the store holds %d identities (%v), want none: the agent created them", n, err)
	}

	// A manager in agent mode, as Cilium's operator, runs the store for
	// its collection and creates nothing: the pods keep waiting.
	idle := startManager(t, filepath.Join(t.TempDir(), "manager-idle"), append(slices.Clone(store),
		"--node-name", "manager-idle", "--identity-management-mode", "agent")...)
	idle.waitFor("/readyz", http.StatusOK, 90*time.Second)
	time.Sleep(3 * time.Second)
	if n, err := identities(); err != nil || n != 0 {
		t.Fatalf("a manager in agent mode ran 3 s: the store holds %d identities (%v), want none", n, err)
	}
	if !strings.Contains(idle.log(), "this manager only runs the store's garbage collection") {
		t.Errorf("the manager in agent mode did not say that it only collects:\n%s", idle.log())
	}
	idle.stop(syscall.SIGTERM)

	start := time.Now()
	manager = startManager(t, filepath.Join(t.TempDir(), "manager"), append(slices.Clone(store),
		"--node-name", "manager-0", "--identity-management-mode", "operator", "--identity-manager-lease-namespace", "default",
		"--leader-election-lease-duration", "4s", "--leader-election-renew-deadline", "3s", "--leader-election-retry-period", "500ms")...)
	ids := waitPodsReady(t, agent, pods, 90*time.Second)
	t.Logf("node-0's %d pods held the manager's identities %s after the manager started", len(pods), time.Since(start).Round(time.Millisecond))

	expectOneIDPerLabelSet(t, pods, ids)
	expectNodeMap(t, agent, "node-0", pods, ids)
	// Every label set once: node-0's 6 and node-1's 3.
	waitUntil(t, 60*time.Second, "one identity per label set of the cluster's pods", func() error {
		n, err := identities()
		if err != nil {
			return err
		}
		if n != 9 {
			return fmt.Errorf("%d identities in the store, want 9", n)
		}
		return nil
	})
	return agent, manager
}

// waitPodsWaiting waits until n pods of the agent in operator mode wait
// for the identity manager, with no identity.
func waitPodsWaiting(t *testing.T, a *healthAgent, n int) {
	t.Helper()
	waitUntil(t, time.Minute, "the agent's pods wait for the identity manager", func() error {
		waiting := 0
		for _, r := range listPods(t, a) {
			if r.State == "waiting for the identity manager" && r.Identity == 0 {
				waiting++
			}
		}
		if waiting != n {
			return fmt.Errorf("%d of %d pods wait", waiting, n)
		}
		return nil
	})
}
