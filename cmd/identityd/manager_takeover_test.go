package main

import (
	"cmp"
	"fmt"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	corev1 "k8s.io/api/core/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	coordinationv1client "k8s.io/client-go/kubernetes/typed/coordination/v1"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"

	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/cells/workloads"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/k8stest"
)

// TestOperatorModeAcceptance runs operatorAcceptance in crd mode, and
// counts at the API server (its audit log) that the agents sent no write
// of a CiliumIdentity. It runs in make test-long (MANAGER_TAKEOVER=1).
func TestOperatorModeAcceptance(t *testing.T) {
	parallelProcess(t)
	if testing.Short() || os.Getenv("MANAGER_TAKEOVER") == "" {
		t.Skip("runs an API server, two managers and three agents: make test-long (MANAGER_TAKEOVER=1)")
	}
	srv, auditLog := auditedServer(t)
	k8stest.InstallCRD(t, srv.RESTConfig(), findObject[*apiextensionsv1.CustomResourceDefinition](t, buildDeploy(t, "crds"), "CustomResourceDefinition")...)
	accounts := applyDeployRBAC(t, srv, "overlays/operator", nil)
	dyn, err := dynamic.NewForConfig(srv.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	operatorAcceptance(t, srv, accounts, func(kubeconfig string) []string {
		return []string{"--identity-allocation-mode=crd", "--k8s-kubeconfig-path", kubeconfig, "--identity-gc-cilium-agents=false"}
	}, func() (int, error) {
		list, err := dyn.Resource(crdstore.CiliumIdentityResource).List(t.Context(), metav1.ListOptions{})
		if err != nil {
			return 0, err
		}
		return len(list.Items), nil
	})
	agent := accounts["agent"].user
	for r, n := range agentRequests(t, auditLog, agent) {
		if r.Resource == "ciliumidentities" && r.Verb != "list" && r.Verb != "watch" {
			t.Errorf("the agents in operator mode sent %s %d times", r, n)
		}
	}
	for _, acc := range accounts {
		for r, n := range refusedRequests(t, auditLog, acc.user) {
			t.Errorf("deploy/overlays/operator's roles refused %s to %s %d times", r, acc.user, n)
		}
	}
}

// TestOperatorModeAcceptanceKVStore runs operatorAcceptance in kvstore
// mode: the identities in an external etcd, the pods read from the API
// server. It runs in make test-long (MANAGER_TAKEOVER=1).
func TestOperatorModeAcceptanceKVStore(t *testing.T) {
	parallelProcess(t)
	if testing.Short() || os.Getenv("MANAGER_TAKEOVER") == "" {
		t.Skip("runs an API server, etcd, two managers and three agents: make test-long (MANAGER_TAKEOVER=1)")
	}
	srv, _ := auditedServer(t)
	accounts := applyDeployRBAC(t, srv, "overlays/operator", nil)
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := etcd.Client(t)
	operatorAcceptance(t, srv, accounts, func(kubeconfig string) []string {
		return []string{"--kvstore-endpoints", strings.Join(etcd.Endpoints(), ","), "--k8s-kubeconfig-path", kubeconfig}
	}, func() (int, error) {
		resp, err := cli.Get(t.Context(), etcdstore.MasterKeyPrefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			return 0, err
		}
		return int(resp.Count), nil
	})
}

// operatorAcceptance: three agents in operator mode, each its own node,
// and two replicas of `identityd manager` in operator mode, each as its
// account of deploy/overlays/operator, with the store flags of store.
// OPERATOR_PODS pods (default 300) of a tenth as many label sets, each set
// on every node, are created before any manager runs: every pod waits for
// the identity manager and the store holds no identity (identities counts
// them at the server): the agents create none. Once the managers run,
// every pod gets its identity, pods of equal labels share one on every
// node, and the store holds one identity per label set. Then
// OPERATOR_TAKEOVER_PODS pods (default 2,000) of new label sets are
// created, and the replica holding the Lease is killed with SIGKILL once
// half are: the other takes the Lease within the lease duration and the
// retries (the default timings: 15 s, every 2 s), every pod holds its
// identity within that takeover and 5 s of the SIGKILL, and the store
// holds one identity per label set, none twice.
func operatorAcceptance(t *testing.T, srv *k8stest.Server, accounts map[string]deployAccount, store func(kubeconfig string) []string, identities func() (int, error)) {
	ctx := t.Context()
	core, err := corev1client.NewForConfig(srv.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	coord, err := coordinationv1client.NewForConfig(srv.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := core.Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	envInt := func(name string, def int) int {
		n, err := strconv.Atoi(cmp.Or(os.Getenv(name), strconv.Itoa(def)))
		if err != nil || n < 30 {
			t.Fatalf("%s=%q: want a number of pods, at least 30", name, os.Getenv(name))
		}
		return n
	}
	first, second := envInt("OPERATOR_PODS", 300), envInt("OPERATOR_TAKEOVER_PODS", 2000)

	nodes := []string{"node-0", "node-1", "node-2"}
	agents := map[string]*healthAgent{}
	for _, node := range nodes {
		agents[node] = startHealthAgentIn(t, filepath.Join(t.TempDir(), node), append(store(accounts["agent"].kubeconfig),
			"--node-name", node, "--identity-management-mode", "operator", "--identity-gc-interval=0")...)
	}
	for _, a := range agents {
		a.waitFor("/readyz", http.StatusOK, 90*time.Second)
	}
	// Pods of label set k are on every node: set i%sets, node (i/sets)%3.
	makePods := func(prefix string, n, offset int) []workloadPod {
		sets := n / 10
		var pods []workloadPod
		for i := range n {
			j := offset + i
			pods = append(pods, workloadPod{ns: "shop", name: fmt.Sprintf("%s-%d", prefix, i), node: nodes[(i/sets)%len(nodes)],
				app: fmt.Sprintf("%s-%d", prefix, i%sets), ips: []string{fmt.Sprintf("10.%d.%d.%d", 6+j/62500, j/250%250, j%250+1)}})
		}
		return pods
	}
	onNode := func(pods []workloadPod, node string) []workloadPod {
		return slices.DeleteFunc(slices.Clone(pods), func(p workloadPod) bool { return p.node != node })
	}
	none := func(workloadPod) bool { return false }
	count := func(want int) func() error {
		return func() error {
			n, err := identities()
			if err != nil {
				return err
			}
			if n != want {
				return fmt.Errorf("%d identities in the store, want %d", n, want)
			}
			return nil
		}
	}

	pods := makePods("a", first, 0)
	createPods(t, core, pods, none)
	for node, a := range agents {
		mine := onNode(pods, node)
		waitUntil(t, time.Minute, node+"'s pods wait for the identity manager", func() error {
			waiting := 0
			for _, r := range listPods(t, a) {
				if r.State == "waiting for the identity manager" && r.Identity == 0 {
					waiting++
				}
			}
			if waiting != len(mine) {
				return fmt.Errorf("%d of %d pods wait", waiting, len(mine))
			}
			return nil
		})
	}
	if err := count(0)(); err != nil {
		t.Fatalf("before any manager runs: %v: the agents created them", err)
	}

	// The election's timings are the defaults, which the Deployment
	// keeps (Cilium operator's).
	lease, retry := workloads.DefaultManagerConfig.LeaderElectionLeaseDuration, workloads.DefaultManagerConfig.LeaderElectionRetryPeriod
	manager := accounts["manager"]
	managers := map[string]*healthAgent{}
	start := time.Now()
	for _, name := range []string{"manager-0", "manager-1"} {
		managers[name] = startManager(t, filepath.Join(t.TempDir(), name), append(store(manager.kubeconfig),
			"--node-name", name, "--identity-management-mode", "operator", "--identity-manager-lease-namespace", manager.namespace(),
			"--identity-gc-lease-namespace", manager.namespace())...)
	}
	ids := map[string]int{}
	for node, a := range agents {
		maps.Copy(ids, waitPodsReady(t, a, onNode(pods, node), 2*time.Minute))
	}
	t.Logf("%d pods of %d label sets on 3 nodes held the manager's identities %s after the managers started", len(pods), first/10, time.Since(start).Round(10*time.Millisecond))
	expectOneIDPerLabelSet(t, pods, ids)
	waitUntil(t, time.Minute, "one identity per label set", count(first/10))

	holder := func() string {
		l, err := coord.Leases(manager.namespace()).Get(ctx, "identityd-manager-0", metav1.GetOptions{})
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
	more := makePods("b", second, first)
	begin := time.Now()
	createPods(t, core, more[:second/2], none)
	killed := time.Now()
	if err := managers[leader].cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	createPods(t, core, more[second/2:], none)
	created := time.Now()
	t.Logf("%d pods created in %s, the Lease's holder %s killed after %d", second, created.Sub(begin).Round(10*time.Millisecond), leader, second/2)
	var takeover time.Duration
	waitUntil(t, lease+4*retry+30*time.Second, "the other manager takes the Lease", func() error {
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
	for node, a := range agents {
		maps.Copy(ids, waitPodsReady(t, a, onNode(more, node), 2*time.Minute))
	}
	// A pod created after the SIGKILL waited at most this long; one
	// created before it the dying replica had mostly served (the first
	// pods got theirs within 2 s of the managers' start).
	ready := time.Since(killed)
	t.Logf("every pod held its identity %s after the SIGKILL, %s after the last creation", ready.Round(10*time.Millisecond), time.Since(created).Round(10*time.Millisecond))
	if ready > takeover+5*time.Second {
		t.Errorf("the last pod held its identity %s after the SIGKILL, more than the takeover (%s) and 5 s", ready, takeover)
	}
	expectOneIDPerLabelSet(t, append(slices.Clone(pods), more...), ids)
	waitUntil(t, time.Minute, "one identity per label set", count(first/10+second/10))
}
