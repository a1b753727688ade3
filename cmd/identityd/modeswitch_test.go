package main

import (
	"context"
	"fmt"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
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

// TestManagementModeRollingSwitch: the rolling switch of guides.md,
// "Operator-managed identities", on a real kube-apiserver in crd mode
// (see rollingSwitch).
func TestManagementModeRollingSwitch(t *testing.T) {
	parallelProcess(t)
	if testing.Short() {
		t.Skip("runs an API server, a manager and agent processes")
	}
	srv := k8stest.Start(t)
	dyn, err := dynamic.NewForConfig(srv.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	store := []string{"--identity-allocation-mode=crd", "--k8s-kubeconfig-path", srv.Kubeconfig(), "--identity-gc-cilium-agents=false"}
	rollingSwitch(t, srv, store, func(ctx context.Context) (map[string][]string, error) {
		list, err := dyn.Resource(crdstore.CiliumIdentityResource).List(ctx, metav1.ListOptions{})
		if err != nil {
			return nil, err
		}
		out := map[string][]string{}
		for _, o := range list.Items {
			raw, _ := o.Object["security-labels"].(map[string]any)
			var lbls []string
			for k, v := range raw {
				lbls = append(lbls, fmt.Sprintf("%s=%v", k, v))
			}
			sort.Strings(lbls)
			key := strings.Join(lbls, ",")
			out[key] = append(out[key], o.GetName())
		}
		return out, nil
	})
}

// TestManagementModeRollingSwitchKVStore is TestManagementModeRollingSwitch
// in kvstore mode, the identities in an external etcd. It runs in make
// test-long (MANAGER_KVSTORE=1).
func TestManagementModeRollingSwitchKVStore(t *testing.T) {
	parallelProcess(t)
	if testing.Short() || os.Getenv("MANAGER_KVSTORE") == "" {
		t.Skip("runs an API server, etcd, a manager and agent processes: make test-long (MANAGER_KVSTORE=1)")
	}
	srv := k8stest.Start(t)
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := etcd.Client(t)
	store := []string{"--kvstore-endpoints", strings.Join(etcd.Endpoints(), ","), "--k8s-kubeconfig-path", srv.Kubeconfig()}
	rollingSwitch(t, srv, store, func(ctx context.Context) (map[string][]string, error) {
		resp, err := cli.Get(ctx, etcdstore.MasterKeyPrefix, clientv3.WithPrefix())
		if err != nil {
			return nil, err
		}
		out := map[string][]string{}
		for _, kv := range resp.Kvs {
			id := strings.TrimPrefix(string(kv.Key), etcdstore.MasterKeyPrefix)
			out[string(kv.Value)] = append(out[string(kv.Value)], id)
		}
		return out, nil
	})
}

// rollingSwitch runs the switch on the store of the flags store, whose
// identities objects returns by label set. Two agents start in agent
// mode; a manager in operator mode starts; the agents are restarted one
// at a time in both, then in operator mode, then back in both and in
// agent mode. New pods come one after another all along (at most one
// every 100 ms), on either node, most with one of ten label sets, every
// seventh with a label set of its own, so that every step creates
// identities. After each restart every pod created so far is ready on its
// node: no pod ever shows two identities (0 renumbered), pods of equal
// labels share one, and at the end no label set has two identities in
// the store (0 duplicates).
func rollingSwitch(t *testing.T, srv *k8stest.Server, store []string, objects func(context.Context) (map[string][]string, error)) {
	ctx := t.Context()
	core, err := corev1client.NewForConfig(srv.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := core.Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	nodes := []string{"node-0", "node-1"}
	dirs := map[string]string{}
	agents := map[string]*healthAgent{}
	start := func(node, mode string) {
		t.Helper()
		if dirs[node] == "" {
			dirs[node] = filepath.Join(t.TempDir(), node)
		}
		a := startHealthAgentIn(t, dirs[node], append(slices.Clone(store), "--node-name", node,
			"--identity-management-mode", mode, "--identity-change-grace-period", workloadsGrace.String())...)
		a.waitFor("/readyz", http.StatusOK, 90*time.Second)
		agents[node] = a
	}
	for _, n := range nodes {
		start(n, "agent")
	}

	// The pods, created one after another until the switch is over.
	var (
		mu      sync.Mutex
		created []workloadPod
		failed  error
	)
	podCtx, stopPods := context.WithCancel(ctx)
	var creating sync.WaitGroup
	creating.Go(func() {
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-podCtx.Done():
				return
			case <-tick.C:
			}
			app := fmt.Sprintf("app-%d", i%10)
			if i%7 == 0 {
				app = fmt.Sprintf("solo-%d", i)
			}
			p := workloadPod{ns: "shop", name: fmt.Sprintf("p-%d", i), node: nodes[i%2], app: app,
				ips: []string{fmt.Sprintf("10.6.%d.%d", i/250, i%250+1)}}
			if err := createPod(podCtx, core, p, false); err != nil {
				if podCtx.Err() == nil {
					mu.Lock()
					failed = err
					mu.Unlock()
				}
				return
			}
			mu.Lock()
			created = append(created, p)
			mu.Unlock()
		}
	})
	defer func() { stopPods(); creating.Wait() }()

	// seen holds every identity each pod was seen with.
	seen := map[string]map[int]bool{}
	var last map[string]int
	check := func(step string) {
		t.Helper()
		mu.Lock()
		pods, err := slices.Clone(created), failed
		mu.Unlock()
		if err != nil {
			t.Fatalf("creating pods: %v", err)
		}
		last = map[string]int{}
		for _, n := range nodes {
			var on []workloadPod
			for _, p := range pods {
				if p.node == n {
					on = append(on, p)
				}
			}
			maps.Copy(last, waitPodsReady(t, agents[n], on, 90*time.Second))
		}
		for k, id := range last {
			if seen[k] == nil {
				seen[k] = map[int]bool{}
			}
			seen[k][id] = true
		}
		t.Logf("%s: %d pods ready", step, len(pods))
	}
	restart := func(node, mode string) {
		t.Helper()
		agents[node].stop(syscall.SIGTERM)
		start(node, mode)
		check(node + " in " + mode + " mode")
	}

	time.Sleep(time.Second)
	check("both nodes in agent mode")
	startManager(t, filepath.Join(t.TempDir(), "manager"), append(slices.Clone(store),
		"--node-name", "manager-0", "--identity-management-mode", "operator", "--identity-manager-lease-namespace", "default")...)
	check("the manager started")
	for _, mode := range []string{"both", "operator", "both", "agent"} {
		for _, n := range nodes {
			restart(n, mode)
		}
	}
	stopPods()
	creating.Wait()
	check("the switch is over")

	mu.Lock()
	pods := slices.Clone(created)
	mu.Unlock()
	for k, ids := range seen {
		if len(ids) > 1 {
			t.Errorf("pod %s was renumbered: identities %v", k, slices.Sorted(maps.Keys(ids)))
		}
	}
	expectOneIDPerLabelSet(t, pods, last)

	byLabels, err := objects(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for key, ids := range byLabels {
		if len(ids) > 1 {
			t.Errorf("label set %s has %d identities in the store: %v", key, len(ids), ids)
		}
	}
	t.Logf("%d pods, %d label sets in the store", len(pods), len(byLabels))
}
