package main

import (
	"cmp"
	"errors"
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
	// Not parallel with the package's other tests: each pod's wait is a
	// latency, which their load on the machine would add to.
	processSlot(t)
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
	processSlot(t) // not parallel, as TestOperatorModeAcceptance
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
// created, and the replica holding the Lease, whose standby watches the
// pods already, is killed with SIGKILL once half are (the second half's label sets are new then): the other takes
// the Lease within the lease duration and two of its looks at it (the
// default timings: 15 s, every 2 s), no pod waits for its identity longer than
// that takeover and 5 s, and the store holds one identity per label set,
// none twice.
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
	// Ten pods in a row share a label set, spread over the nodes (node
	// i%3): the pods created after the SIGKILL below bring label sets of
	// their own, which only the next manager can create.
	makePods := func(prefix string, n, offset int) []workloadPod {
		var pods []workloadPod
		for i := range n {
			j := offset + i
			pods = append(pods, workloadPod{ns: "shop", name: fmt.Sprintf("%s-%d", prefix, i), node: nodes[i%len(nodes)],
				app: fmt.Sprintf("%s-%d", prefix, i/10), ips: []string{fmt.Sprintf("10.%d.%d.%d", 6+j/62500, j/250%250, j%250+1)}})
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
		waitPodsWaiting(t, a, len(onNode(pods, node)))
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
	// The standby watches the pods already, so that it serves at once
	// once it holds the Lease.
	for name, m := range managers {
		if name == leader {
			continue
		}
		waitUntil(t, time.Minute, "the standby "+name+" watches the pods", func() error {
			_, body := m.probe("/metrics")
			for line := range strings.Lines(body) {
				if strings.HasPrefix(line, "identityd_k8s_requests_total{") && strings.Contains(line, `resource="pods"`) && strings.Contains(line, `verb="watch"`) {
					return nil
				}
			}
			return errors.New("no watch of pods in its identityd_k8s_requests_total")
		})
	}
	more := makePods("b", second, first)
	// The pods are created, and the holder killed half way, while this
	// goroutine looks at the agents' pods and the Lease every quarter
	// second: each pod's wait is from the end of its creation to the
	// first look that shows it ready.
	type creation struct {
		at            map[string]time.Time
		begin, killed time.Time
		end           time.Time
		err           error
	}
	done := make(chan creation, 1)
	go func() {
		c := creation{begin: time.Now()}
		c.at, c.err = createPodsAt(ctx, core, more[:second/2], none)
		if c.err == nil {
			c.killed = time.Now()
			c.err = managers[leader].cmd.Process.Kill()
		}
		if c.err == nil {
			var rest map[string]time.Time
			rest, c.err = createPodsAt(ctx, core, more[second/2:], none)
			maps.Copy(c.at, rest)
		}
		c.end = time.Now()
		done <- c
	}()
	var (
		c       *creation
		takenAt time.Time
		readyAt = map[string]time.Time{}
		wantIPs = map[string]int{}
	)
	for _, p := range more {
		wantIPs[p.key()] = len(p.ips)
	}
	waitUntil(t, lease+4*retry+2*time.Minute, "every pod holds its identity and the other manager the Lease", func() error {
		if c == nil {
			select {
			case r := <-done:
				if r.err != nil {
					t.Fatal(r.err)
				}
				c = &r
			default:
			}
		}
		for _, a := range agents {
			rows := listPods(t, a)
			now := time.Now()
			for _, r := range rows {
				if _, seen := readyAt[r.Name]; !seen && r.State == "ready" && r.Identity != 0 && hasKey(wantIPs, r.Name) && len(r.IPs) == wantIPs[r.Name] {
					readyAt[r.Name], ids[r.Name] = now, r.Identity
				}
			}
		}
		if h := holder(); takenAt.IsZero() && h != leader && managers[h] != nil {
			takenAt = time.Now()
		}
		switch {
		case c == nil:
			return errors.New("the pods are being created")
		case takenAt.IsZero():
			return errors.New("no other manager holds the Lease")
		case len(readyAt) < len(more):
			return fmt.Errorf("%d of %d pods hold their identity", len(readyAt), len(more))
		}
		return nil
	})
	takeover := takenAt.Sub(c.killed)
	t.Logf("%d pods created in %s, the Lease's holder %s killed after %d; the Lease changed hands %s after the SIGKILL",
		second, c.end.Sub(c.begin).Round(10*time.Millisecond), leader, second/2, takeover.Round(10*time.Millisecond))
	// A candidate looks every retry period, jittered up to 2.2 times it
	// (client-go's JitterFactor 1.2): it sees the last renewal up to one
	// look after it was written, and takes the Lease up to one look after
	// the lease ran out from there; 3 s for the requests of a loaded
	// machine.
	look := time.Duration(2.2 * float64(retry))
	if bound := lease + 2*look + 3*time.Second; takeover > bound {
		t.Errorf("the takeover took %s, more than the lease, two looks and 3 s (%s)", takeover, bound)
	}
	var longest time.Duration
	var longestPod string
	for _, p := range more {
		if w := readyAt[p.key()].Sub(c.at[p.key()]); w > longest {
			longest, longestPod = w, p.key()
		}
	}
	t.Logf("the longest wait: %s, %s, created %s after the SIGKILL; every pod held its identity %s after the last creation",
		longest.Round(10*time.Millisecond), longestPod, c.at[longestPod].Sub(c.killed).Round(10*time.Millisecond), time.Since(c.end).Round(10*time.Millisecond))
	if longest > takeover+5*time.Second {
		t.Errorf("pod %s waited %s for its identity, more than the takeover (%s) and 5 s", longestPod, longest, takeover)
	}
	expectOneIDPerLabelSet(t, append(slices.Clone(pods), more...), ids)
	waitUntil(t, time.Minute, "one identity per label set", count(first/10+second/10))
}
