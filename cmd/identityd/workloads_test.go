package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"

	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/k8stest"
	"github.com/identityd/identityd/internal/testproc"
)

// workloadsGrace is the agents' --identity-change-grace-period in the
// workloads tests: short, so that the releases are seen soon, long enough
// to tell a release after it from one before.
const workloadsGrace = 3 * time.Second

// TestWorkloadsCRD runs the workloads acceptance on a real kube-apiserver in
// crd mode (see workloadsAcceptance).
func TestWorkloadsCRD(t *testing.T) {
	parallelProcess(t)
	if testing.Short() {
		t.Skip("runs an API server and agent processes")
	}
	srv := k8stest.Start(t)
	workloadsAcceptance(t, srv, func(kubeconfig string) []string {
		return []string{"--identity-allocation-mode=crd", "--k8s-kubeconfig-path", kubeconfig}
	})
}

// TestWorkloadsKVStore is TestWorkloadsCRD in kvstore mode: the identities in
// an external etcd, the pods read from the API server of
// --k8s-kubeconfig-path.
func TestWorkloadsKVStore(t *testing.T) {
	parallelProcess(t)
	if testing.Short() {
		t.Skip("runs an API server, etcd and agent processes")
	}
	srv := k8stest.Start(t)
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	workloadsAcceptance(t, srv, func(kubeconfig string) []string {
		return []string{"--kvstore-endpoints", strings.Join(etcd.Endpoints(), ","), "--k8s-kubeconfig-path", kubeconfig}
	})
}

// listedPod is a row of workloads/list -o json.
type listedPod struct {
	Name     string   `json:"pod"`
	IPs      []string `json:"ips"`
	Identity int      `json:"identity"`
	State    string   `json:"state"`
}

// workloadPod is a pod the test creates: its node, its identity labels'
// share (pods of one group have equal labels) and its IPs.
type workloadPod struct {
	ns, name, node, app string
	ips                 []string
}

func (p workloadPod) key() string   { return p.ns + "/" + p.name }
func (p workloadPod) group() string { return p.ns + "/" + p.app }

// workloadsAcceptance: three agent processes of the real binary, each its
// own node, and WORKLOADS_PODS pods (default 300) spread over the nodes,
// created with spec.nodeName and their IPs written through the status
// subresource (no kubelet). Every pod gets one identity; pods with equal
// labels share it, on every node; each node's datapath map holds exactly
// its own pods' IPs with their identities (a host-network pod's IP in
// none); a relabelled pod's and a deleted pod's old identities are
// released after the grace period, not before; a node killed with SIGKILL
// and restarted gives every one of its pods the same number again, and
// its map holds them all; a namespace's new labels move its pods on every
// node to new shared identities and release the old ones after the grace
// period, and leave the other namespace's pods alone.
func workloadsAcceptance(t *testing.T, srv *k8stest.Server, storeArgs func(kubeconfig string) []string) {
	ctx := t.Context()
	core, err := corev1client.NewForConfig(srv.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	nPods := testproc.CountFromEnv(t, "WORKLOADS_PODS", 300, 30)
	nodes := []string{"node-0", "node-1", "node-2"}
	for i, ns := range []string{"shop", "billing"} {
		_, err := core.Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns,
			Labels: map[string]string{"team": fmt.Sprint("t", i)}}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
	}

	// Pod i: namespace i%2, app i%25, node i%3: 50 label sets, each on
	// every node.
	var pods []workloadPod
	for i := range nPods {
		pods = append(pods, workloadPod{
			ns: []string{"shop", "billing"}[i%2], name: fmt.Sprintf("p-%d", i), node: nodes[i%3],
			app: fmt.Sprintf("app-%d", i%25),
			ips: []string{fmt.Sprintf("10.1.%d.%d", i/250, i%250+1), fmt.Sprintf("fd00::1:%x", i)},
		})
	}
	// A pod of its own label set on each of two nodes, for the relabel and
	// the deletion, and a host-network pod.
	solo := workloadPod{ns: "shop", name: "solo", node: "node-1", app: "solo", ips: []string{"10.2.0.1"}}
	gone := workloadPod{ns: "shop", name: "gone", node: "node-2", app: "gone", ips: []string{"10.2.0.2"}}
	// A label set only node-0 holds: its number must survive node-0's
	// SIGKILL with no other node holding it.
	only0 := workloadPod{ns: "billing", name: "only0", node: "node-0", app: "only0", ips: []string{"10.2.0.3", "fd00::2:3"}}
	pods = append(pods, solo, gone, only0)
	host := workloadPod{ns: "shop", name: "host", node: "node-0", app: "host", ips: []string{"192.168.0.10"}}

	agents := map[string]*healthAgent{}
	dirs := map[string]string{}
	args := func(node string) []string {
		return append(storeArgs(srv.Kubeconfig()), "--node-name", node,
			"--identity-change-grace-period", workloadsGrace.String())
	}
	for _, node := range nodes {
		dirs[node] = filepath.Join(t.TempDir(), node)
		agents[node] = startHealthAgentIn(t, dirs[node], args(node)...)
	}
	for _, node := range nodes {
		agents[node].waitFor("/readyz", http.StatusOK, 90*time.Second)
	}

	start := time.Now()
	createPods(t, core, append(slices.Clone(pods), host), func(p workloadPod) bool { return p.key() == host.key() })
	t.Logf("%d pods created with their IPs in %s", len(pods)+1, time.Since(start).Round(time.Millisecond))

	byNode := map[string][]workloadPod{}
	for _, p := range pods {
		byNode[p.node] = append(byNode[p.node], p)
	}
	ids := map[string]int{} // pod key -> identity
	for _, node := range nodes {
		maps.Copy(ids, waitPodsReady(t, agents[node], byNode[node], 120*time.Second))
	}
	t.Logf("every pod held its identity %s after the creations began", time.Since(start).Round(time.Millisecond))

	// One identity per label set, the same on every node; another per
	// other label set.
	expectOneIDPerLabelSet(t, pods, ids)
	for _, node := range nodes {
		expectNodeMap(t, agents[node], node, byNode[node], ids)
	}
	// The metrics say the same: no pod without identity, each pod's
	// wait observed once, no failed allocation.
	for _, node := range nodes {
		a := agents[node]
		for series, want := range map[string]float64{
			"identityd_workloads_pods_without_identity":       0,
			"identityd_workloads_identity_wait_seconds_count": float64(len(byNode[node])),
			"identityd_workloads_allocation_failures_total":   0,
		} {
			if got, ok := a.metricValue(series); !ok || got != want {
				t.Errorf("%s: %s = %g (found: %t), want %g", node, series, got, ok, want)
			}
		}
	}
	if rows := listPods(t, agents["node-0"]); !slices.ContainsFunc(rows, func(r listedPod) bool {
		return r.Name == host.key() && r.Identity == 0 && r.State == "host network" && len(r.IPs) == 0
	}) {
		t.Errorf("the host-network pod in node-0's workloads/list: %+v", rows)
	}

	if refs := refCount(t, agents["node-1"], ids[only0.key()]); refs != 0 {
		t.Errorf("node-1 holds %d references on node-0's own identity %d", refs, ids[only0.key()])
	}

	// A relabelled pod gets a new identity at once; its old one, which no
	// other pod holds, goes after the grace period. So does a deleted
	// pod's.
	soloOld, goneOld := ids[solo.key()], ids[gone.key()]
	relabelled := time.Now()
	p, err := core.Pods(solo.ns).Get(ctx, solo.name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p.Labels["app"] = "solo-v2"
	if _, err := core.Pods(solo.ns).Update(ctx, p, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := core.Pods(gone.ns).Delete(ctx, gone.name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	deleted := time.Now()
	// Read before anything waits, so that the holds are seen on a loaded
	// machine too.
	soloHeld := refCount(t, agents["node-1"], soloOld) > 0
	goneHeld := refCount(t, agents["node-2"], goneOld) > 0
	var soloNew int
	waitUntil(t, 60*time.Second, "the relabelled pod's new identity", func() error {
		for _, r := range listPods(t, agents["node-1"]) {
			if r.Name == solo.key() && r.State == "ready" && r.Identity != soloOld && r.Identity != 0 {
				soloNew = r.Identity
				return nil
			}
		}
		return fmt.Errorf("%s not on a new identity yet", solo.key())
	})
	expectReleasedAfterGrace(t, agents["node-1"], soloOld, relabelled, soloHeld)
	expectReleasedAfterGrace(t, agents["node-2"], goneOld, deleted, goneHeld)
	if refs := refCount(t, agents["node-1"], soloNew); refs != 1 {
		t.Errorf("the relabelled pod's new identity %d: %d references on node-1, want 1", soloNew, refs)
	}
	ids[solo.key()] = soloNew
	delete(ids, gone.key())
	byNode["node-2"] = slices.DeleteFunc(byNode["node-2"], func(p workloadPod) bool { return p.key() == gone.key() })
	expectNodeMap(t, agents["node-1"], "node-1", byNode["node-1"], ids)
	expectNodeMap(t, agents["node-2"], "node-2", byNode["node-2"], ids)

	// SIGKILL and restart: every pod of the node keeps its number, and the
	// node's map its IPs.
	agents["node-0"].stop(syscall.SIGKILL)
	restarted := time.Now()
	agents["node-0"] = startHealthAgentIn(t, dirs["node-0"], args("node-0")...)
	agents["node-0"].waitFor("/readyz", http.StatusOK, 90*time.Second)
	after := waitPodsReady(t, agents["node-0"], byNode["node-0"], 120*time.Second)
	t.Logf("node-0's %d pods held their identities %s after the restart began", len(after), time.Since(restarted).Round(time.Millisecond))
	for key, id := range after {
		if id != ids[key] {
			t.Errorf("after SIGKILL and restart, %s has identity %d, had %d", key, id, ids[key])
		}
	}
	expectNodeMap(t, agents["node-0"], "node-0", byNode["node-0"], ids)

	// A namespace's new labels move each of its pods, on every node, to
	// the identity of its new label set, shared as before; the old ones
	// go after the grace period; the other namespace's pods keep theirs.
	nsObj, err := core.Namespaces().Get(ctx, "billing", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	nsObj.Labels["team"] = "t9"
	if _, err := core.Namespaces().Update(ctx, nsObj, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	nsRelabelled := time.Now()
	oldBilling := map[int]bool{}
	for _, p := range pods {
		if p.ns == "billing" {
			oldBilling[ids[p.key()]] = true
		}
	}
	// Read before anything waits: the old identities are held still.
	for _, node := range nodes {
		for id := range oldBilling {
			if refCount(t, agents[node], id) == 0 {
				t.Logf("%s: identity %d not held right after the namespace relabel (a loaded machine)", node, id)
			}
			break
		}
	}
	moved := map[string]int{}
	for _, node := range nodes {
		waitUntil(t, 60*time.Second, node+"'s billing pods on new identities", func() error {
			for _, r := range listPods(t, agents[node]) {
				if strings.HasPrefix(r.Name, "billing/") && (r.State != "ready" || oldBilling[r.Identity]) {
					return fmt.Errorf("%s: %+v", r.Name, r)
				}
				moved[r.Name] = r.Identity
			}
			return nil
		})
	}
	t.Logf("every billing pod on its new identity %s after the namespace relabel", time.Since(nsRelabelled).Round(time.Millisecond))
	newGroup := map[string]int{}
	for _, p := range pods {
		if p.key() == gone.key() {
			continue
		}
		id := moved[p.key()]
		if p.ns != "billing" {
			if id != ids[p.key()] {
				t.Errorf("%s of another namespace moved from %d to %d", p.key(), ids[p.key()], id)
			}
			continue
		}
		if g, ok := newGroup[p.group()]; ok && g != id {
			t.Errorf("%s has identity %d, another pod of its labels %d", p.key(), id, g)
		}
		newGroup[p.group()] = id
		ids[p.key()] = id
	}
	for _, node := range nodes {
		expectNodeMap(t, agents[node], node, byNode[node], ids)
	}
	for _, node := range nodes {
		waitUntil(t, workloadsGrace+60*time.Second, node+" releases the old billing identities", func() error {
			held := heldIdentities(t, agents[node])
			for id := range oldBilling {
				if held[id] > 0 {
					return fmt.Errorf("identity %d has %d references", id, held[id])
				}
			}
			return nil
		})
		if took := time.Since(nsRelabelled); took < workloadsGrace {
			t.Errorf("%s released the old billing identities %s after the relabel, before the grace period of %s", node, took.Round(time.Millisecond), workloadsGrace)
		}
	}
}

// createPods creates the pods, each bound to its node, and writes their
// IPs and phase Running through the status subresource, as a kubelet
// would; hostNetwork(p) marks the pods that use the node's network.
// expectOneIDPerLabelSet checks that pods of equal labels hold one
// identity (ids, by pod key) and pods of other labels another.
func expectOneIDPerLabelSet(t *testing.T, pods []workloadPod, ids map[string]int) {
	t.Helper()
	groupID, idGroup := map[string]int{}, map[int]string{}
	for _, p := range pods {
		id := ids[p.key()]
		if g, ok := groupID[p.group()]; ok && g != id {
			t.Errorf("%s has identity %d, another pod of its labels %d", p.key(), id, g)
		}
		groupID[p.group()] = id
		if g, ok := idGroup[id]; ok && g != p.group() {
			t.Errorf("identity %d is given to the labels of %s and of %s", id, g, p.group())
		}
		idGroup[id] = p.group()
	}
}

func createPods(t *testing.T, core corev1client.CoreV1Interface, pods []workloadPod, hostNetwork func(workloadPod) bool) {
	t.Helper()
	if _, err := createPodsAt(t.Context(), core, pods, hostNetwork); err != nil {
		t.Fatal(err)
	}
}

// createPodsAt creates the pods 8 at a time and returns when each one's
// creation (its IPs written) returned, by pod key.
func createPodsAt(ctx context.Context, core corev1client.CoreV1Interface, pods []workloadPod, hostNetwork func(workloadPod) bool) (map[string]time.Time, error) {
	work := make(chan workloadPod)
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
		at   = map[string]time.Time{}
	)
	for range 8 {
		wg.Go(func() {
			for p := range work {
				err := createPod(ctx, core, p, hostNetwork(p))
				now := time.Now()
				mu.Lock()
				if err != nil {
					errs = append(errs, err)
				} else {
					at[p.key()] = now
				}
				mu.Unlock()
			}
		})
	}
	for _, p := range pods {
		work <- p
	}
	close(work)
	wg.Wait()
	return at, errors.Join(errs...)
}

func createPod(ctx context.Context, core corev1client.CoreV1Interface, p workloadPod, hostNetwork bool) error {
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: p.name, Namespace: p.ns,
			// pod-template-hash is different on every pod and no
			// identity label: pods of one app still share an identity.
			Labels: map[string]string{"app": p.app, "pod-template-hash": p.name}},
		Spec: corev1.PodSpec{NodeName: p.node, HostNetwork: hostNetwork,
			Containers: []corev1.Container{{Name: "c", Image: "registry.invalid/none"}}},
	}
	created, err := core.Pods(p.ns).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("create pod %s: %w", p.key(), err)
	}
	created.Status.Phase = corev1.PodRunning
	created.Status.PodIP = p.ips[0]
	for _, ip := range p.ips {
		created.Status.PodIPs = append(created.Status.PodIPs, corev1.PodIP{IP: ip})
	}
	if _, err := core.Pods(p.ns).UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("status of pod %s: %w", p.key(), err)
	}
	return nil
}

// listPods runs workloads/list -o json on the agent.
func listPods(t *testing.T, a *healthAgent) []listedPod {
	t.Helper()
	sh := a.dial()
	defer sh.Close()
	out, err := sh.Run(time.Now().Add(time.Minute), "workloads/list", "-o", "json")
	if err != nil {
		t.Fatalf("workloads/list: %v\n%s", err, out)
	}
	var rows []listedPod
	if err := json.Unmarshal([]byte(out), &rows); err != nil {
		t.Fatalf("workloads/list -o json: %v\n%s", err, out)
	}
	return rows
}

// waitPodsReady waits until the agent lists every pod of want as ready
// with its IPs and an identity, and returns the identities by pod key.
func waitPodsReady(t *testing.T, a *healthAgent, want []workloadPod, within time.Duration) map[string]int {
	t.Helper()
	var ids map[string]int
	waitUntil(t, within, "every pod of the node ready", func() error {
		rows := map[string]listedPod{}
		for _, r := range listPods(t, a) {
			rows[r.Name] = r
		}
		ids = map[string]int{}
		missing := 0
		var example string
		for _, p := range want {
			r, ok := rows[p.key()]
			if !ok || r.State != "ready" || r.Identity == 0 || len(r.IPs) != len(p.ips) {
				missing++
				example = fmt.Sprintf("%s: %+v", p.key(), r)
				continue
			}
			ids[p.key()] = r.Identity
		}
		if missing > 0 {
			return fmt.Errorf("%d of %d pods not ready, e.g. %s", missing, len(want), example)
		}
		return nil
	})
	return ids
}

// expectNodeMap checks the node's datapath map (the file backend's, read
// by ipcache/map-dump): exactly the IPs of its pods, each with its pod's
// identity.
func expectNodeMap(t *testing.T, a *healthAgent, node string, pods []workloadPod, ids map[string]int) {
	t.Helper()
	want := map[string]int{}
	for _, p := range pods {
		for _, ip := range p.ips {
			bits := 32
			if strings.Contains(ip, ":") {
				bits = 128
			}
			want[fmt.Sprintf("%s/%d", ip, bits)] = ids[p.key()]
		}
	}
	var got map[string]int
	// The reconciler writes the map shortly after the table.
	waitUntil(t, 30*time.Second, node+"'s map holds exactly its pods' IPs", func() error {
		sh := a.dial()
		defer sh.Close()
		out, err := sh.Run(time.Now().Add(time.Minute), "ipcache/map-dump", "-o", "json")
		if err != nil {
			return fmt.Errorf("ipcache/map-dump: %v %s", err, out)
		}
		var rows []struct {
			Prefix   string `json:"prefix"`
			Identity int    `json:"identity"`
		}
		if err := json.Unmarshal([]byte(out), &rows); err != nil {
			return fmt.Errorf("ipcache/map-dump -o json: %v", err)
		}
		got = map[string]int{}
		for _, r := range rows {
			got[r.Prefix] = r.Identity
		}
		if !maps.Equal(got, want) {
			var extra, wrong []string
			for p, id := range got {
				if w, ok := want[p]; !ok {
					extra = append(extra, p)
				} else if w != id {
					wrong = append(wrong, fmt.Sprintf("%s=%d (want %d)", p, id, w))
				}
			}
			return fmt.Errorf("map has %d entries, want %d; not this node's pods': %v; wrong identity: %v", len(got), len(want), extra, wrong)
		}
		return nil
	})
}

// refCount is the agent's reference count on identity id (0 when it does
// not list it).
func refCount(t *testing.T, a *healthAgent, id int) int {
	t.Helper()
	return heldIdentities(t, a)[id]
}

// heldIdentities is the agent's reference count of every identity it lists.
func heldIdentities(t *testing.T, a *healthAgent) map[int]int {
	t.Helper()
	sh := a.dial()
	defer sh.Close()
	out, err := sh.Run(time.Now().Add(time.Minute), "identity/list", "-o", "json")
	if err != nil {
		t.Fatalf("identity/list: %v\n%s", err, out)
	}
	var entries []struct {
		Identity struct {
			ID int `json:"id"`
		} `json:"identity"`
		RefCount int `json:"ref-count"`
	}
	if err := json.Unmarshal([]byte(out), &entries); err != nil {
		t.Fatalf("identity/list -o json: %v\n%s", err, out)
	}
	held := map[int]int{}
	for _, e := range entries {
		held[e.Identity.ID] = e.RefCount
	}
	return held
}

// expectReleasedAfterGrace waits until the agent holds no reference on id
// and fails when that happened before the grace period after since;
// heldSeen says a reference was seen after since already.
func expectReleasedAfterGrace(t *testing.T, a *healthAgent, id int, since time.Time, heldSeen bool) {
	t.Helper()
	for {
		refs := refCount(t, a, id)
		if refs > 0 {
			heldSeen = true
		}
		if refs == 0 {
			if took := time.Since(since); took < workloadsGrace {
				t.Errorf("identity %d released %s after its pod changed, before the grace period of %s", id, took.Round(time.Millisecond), workloadsGrace)
			} else if !heldSeen {
				t.Logf("identity %d: first read after the grace period (a loaded machine); its hold was not observed", id)
			}
			return
		}
		if time.Since(since) > workloadsGrace+60*time.Second {
			t.Fatalf("identity %d still has %d references %s after its pod changed", id, refs, time.Since(since).Round(time.Second))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// TestWorkloadsManagementModeRefused: the agent refuses to start with an
// identity management mode that is not one, with an error naming the flag
// and the modes, whether or not it has a Kubernetes client.
func TestWorkloadsManagementModeRefused(t *testing.T) {
	parallelProcess(t)
	if testing.Short() {
		t.Skip("starts agent processes")
	}
	for _, mode := range []string{"operators", "Agent"} {
		out, err := runAgentToExit(t, "--state-dir", t.TempDir(), "--identity-management-mode", mode,
			"--ipcache-map", "file", "--prometheus-serve-addr", "", "--log-level", "error")
		if err == nil || !strings.Contains(out, "--identity-management-mode \""+mode+"\"") || !strings.Contains(out, `want "agent", "operator" or "both"`) {
			t.Errorf("--identity-management-mode=%s: %v, want a refusal naming the flag and the modes:\n%s", mode, err, out)
		}
	}
}
