package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/client-go/dynamic"

	"github.com/identityd/identityd/internal/k8stest"
)

// TestCRDModeKilledNodeGC runs two agent processes and two replicas of the
// identity manager in crd mode with a short IdentityNode lease and GC
// period; one replica collects (identityd_crd_identity_gc_leader). One
// agent and the collecting replica are killed with SIGKILL: the other
// replica takes the collection over within one IdentityNode lease, and
// once the killed node's lease ended its garbage collection marks the
// identities only the killed node used (and the one the live node
// released), deletes them once their marks are a heartbeat timeout old
// (the test dates the marks back rather than wait), keeps the one the
// live node uses, and deletes the IdentityNode records of the dead node
// and of the dead replica. The agents and the managers run as deploy/base's
// ServiceAccounts, with tokens from TokenRequest, on a kube-apiserver
// whose RBAC authorizer has deploy/base's roles and bindings, with
// deploy/crds installed first as an administrator does. The API server's
// audit log of the run is then checked against each account's roles:
// every (group, resource, verb) it sent is granted, and every grant was
// used or is explained.
func TestCRDModeKilledNodeGC(t *testing.T) {
	waitingParallel(t)
	if testing.Short() {
		t.Skip("runs an API server, agent and manager processes for minutes")
	}
	dir := t.TempDir()
	srv, auditLog := auditedServer(t)
	objs := newAPIObjects(t, srv)
	// The CRDs of deploy/crds, which an administrator installs: the
	// agents and the managers only read them.
	k8stest.InstallCRD(t, srv.RESTConfig(), findObject[*apiextensionsv1.CustomResourceDefinition](t, buildDeploy(t, "crds"), "CustomResourceDefinition")...)
	accounts := applyDeployRBAC(t, srv, "base", nil)
	agentAcc, managerAcc := accounts["agent"], accounts["manager"]
	dyn, err := dynamic.NewForConfig(srv.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	// The agents delete nothing: the collection is the manager's.
	for _, r := range []apiRequest{{Group: "cilium.io", Resource: "ciliumidentities"}, {Group: "identityd.io", Resource: "identitynodes"}} {
		if err := accessAllowed(t, dyn, agentAcc.user, agentAcc.namespace(), r.Group, r.Resource, "delete"); err == nil {
			t.Errorf("deploy/base lets the agents delete %s.%s", r.Resource, r.Group)
		}
	}

	// No Cilium agent runs here: --identity-gc-cilium-agents=false allows
	// the 2m timeout that keeps the run within minutes. The agents do not
	// collect, as in deploy/base.
	const lease = "--identity-node-lease-ttl=25s"
	managerFlags := []string{lease, "--identity-gc-interval=3s", "--identity-heartbeat-timeout=2m",
		"--identity-gc-cilium-agents=false", "--identity-gc-lease-namespace=" + managerAcc.namespace()}
	managers := map[string]*healthAgent{}
	for _, name := range []string{"manager-a", "manager-b"} {
		m := startManager(t, filepath.Join(dir, name), crdAgentArgs(managerAcc.kubeconfig, name, managerFlags...)...)
		m.waitFor("/readyz", http.StatusOK, 90*time.Second)
		managers[name] = m
	}
	agentFlags := []string{lease, "--identity-gc-interval=0", "--identity-restore-grace-period=1s"}
	agents := map[string]*healthAgent{
		"node-a": startCRDAgent(t, filepath.Join(dir, "a"), agentAcc.kubeconfig, "node-a", agentFlags...),
		"node-b": startCRDAgent(t, filepath.Join(dir, "b"), agentAcc.kubeconfig, "node-b", agentFlags...),
	}
	const leaderSeries = "identityd_crd_identity_gc_leader"
	collectors := func() []string {
		var out []string
		for name, m := range managers {
			if v, _ := m.metricValue(leaderSeries); v == 1 {
				out = append(out, name)
			}
		}
		return out
	}
	var collector string
	waitUntil(t, time.Minute, "exactly one manager collects", func() error {
		c := collectors()
		if len(c) != 1 {
			return fmt.Errorf("collectors %v", c)
		}
		collector = c[0]
		return nil
	})
	for name, a := range agents {
		if v, ok := a.metricValue(leaderSeries); v != 0 {
			t.Errorf("agent %s collects: %s = %v (found %t)", name, leaderSeries, v, ok)
		}
	}
	a, b := agents["node-a"], agents["node-b"]
	shA, shB := a.dial(), b.dial()
	defer shA.Close()

	onlyB := allocate(t, shB, "k8s:app=only-b")
	shared := allocate(t, shB, "k8s:app=shared")
	if got := allocate(t, shA, "k8s:app=shared"); got != shared {
		t.Fatalf("node-a got %d for the label set node-b holds as %d", got, shared)
	}
	released := allocate(t, shA, "k8s:app=released")
	if out, err := shA.Run(time.Now().Add(time.Minute), "identity/release", strconv.Itoa(released)); err != nil {
		t.Fatalf("release: %v %s", err, out)
	}
	waitUntil(t, 30*time.Second, "the killed node's IdentityNode lists its identities", func() error {
		for _, id := range []int{onlyB, shared} {
			if err := objs.lists("node-b", id, true)(); err != nil {
				return err
			}
		}
		return nil
	})
	shB.Close()
	b.stop(syscall.SIGKILL)
	managers[collector].stop(syscall.SIGKILL)
	killed := time.Now()
	delete(agents, "node-b")
	delete(managers, collector)
	// The election's lease is 0.4 of the IdentityNode lease and
	// candidates look every eighth of it: a takeover within the
	// IdentityNode lease (25s), and room for a loaded machine.
	waitUntil(t, 25*time.Second+15*time.Second, "the other manager collects", func() error {
		if c := collectors(); len(c) != 1 {
			return fmt.Errorf("collectors %v", c)
		}
		return nil
	})
	t.Logf("the other manager collects %s after SIGKILL of %s", time.Since(killed).Round(100*time.Millisecond), collector)

	// Once the killed node's lease ended the collector marks what no
	// live node uses. The test then dates those marks a heartbeat
	// timeout back, as a collector of an hour ago would have left them,
	// instead of waiting the timeout out; the next run deletes them.
	// Lease (25s) + a GC period, on a loaded machine.
	waitUntil(t, 2*time.Minute, "the GC marks the identities only the killed node and no live node used", func() error {
		for _, id := range []int{onlyB, released} {
			if objs.mark(id) == "" {
				return fmt.Errorf("CiliumIdentity %d is not marked", id)
			}
		}
		return nil
	})
	t.Logf("the killed node's identities were marked %s after SIGKILL", time.Since(killed).Round(time.Second))
	if m := objs.mark(shared); m != "" {
		t.Errorf("CiliumIdentity %d, used by the live node, got the mark %q", shared, m)
	}
	for _, id := range []int{onlyB, released} {
		objs.backdateMark(id, time.Now().Add(-time.Hour))
	}
	waitUntil(t, time.Minute, "the GC deletes the identities only the killed node and no live node used", func() error {
		var left []int
		for _, id := range []int{onlyB, released} {
			if objs.identity(id) != nil {
				left = append(left, id)
			}
		}
		if len(left) > 0 {
			return fmt.Errorf("CiliumIdentity objects %v still exist", left)
		}
		return nil
	})
	t.Logf("the killed node's identities were deleted %s after SIGKILL", time.Since(killed).Round(time.Second))
	if lbls := objs.identity(shared); lbls["k8s:app"] != "shared" {
		t.Errorf("CiliumIdentity %d, used by the live node, is gone: %v", shared, lbls)
	}
	waitUntil(t, 2*time.Minute, "the GC deletes the IdentityNode records of the dead node and the dead replica", func() error {
		for _, name := range []string{"node-b", collector} {
			if _, ok := objs.nodeIdentities(name); ok {
				return fmt.Errorf("IdentityNode %s still exists", name)
			}
		}
		return nil
	})
	if err := objs.lists("node-a", shared, true)(); err != nil {
		t.Error(err)
	}
	// The live node allocates the freed label set again.
	again := allocate(t, shA, "k8s:app=only-b")
	if objs.identity(again)["k8s:app"] != "only-b" {
		t.Errorf("CiliumIdentity %d of the reallocated label set is missing", again)
	}

	checkRoles(t, agentAcc, agentRequests(t, auditLog, agentAcc.user), unexercisedByAgents)
	checkRoles(t, managerAcc, agentRequests(t, auditLog, managerAcc.user), unexercisedByManagers)
	for _, acc := range accounts {
		for r, n := range refusedRequests(t, auditLog, acc.user) {
			t.Errorf("deploy/base's roles refused %s to %s %d times", r, acc.user, n)
		}
	}
}

// apiRequest is what RBAC authorizes of a request: a resource request's
// group, resource and verb, or a non-resource request's path.
type apiRequest struct {
	Group, Resource, Verb string
	Path                  string // non-resource requests
}

func (r apiRequest) String() string {
	if r.Resource == "" {
		return r.Verb + " " + r.Path
	}
	g := r.Group
	if g == "" {
		g = "core"
	}
	return r.Verb + " " + r.Resource + "." + g
}

// agentRequests reads the distinct requests of agentUser from the API
// server's audit log.
func agentRequests(t *testing.T, path, agentUser string) map[apiRequest]int {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	seen := map[apiRequest]int{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var ev struct {
			Stage      string
			Verb       string
			RequestURI string `json:"requestURI"`
			User       struct{ Username string }
			ObjectRef  *struct {
				Resource string `json:"resource"`
				APIGroup string `json:"apiGroup"`
			} `json:"objectRef"`
		}
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			t.Fatalf("audit log: %v", err)
		}
		if ev.User.Username != agentUser || ev.Stage == "ResponseStarted" {
			continue
		}
		r := apiRequest{Verb: ev.Verb}
		if ev.ObjectRef != nil && ev.ObjectRef.Resource != "" {
			r.Group, r.Resource = ev.ObjectRef.APIGroup, ev.ObjectRef.Resource
		} else {
			r.Path, _, _ = strings.Cut(ev.RequestURI, "?")
		}
		seen[r]++
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if len(seen) == 0 {
		t.Fatalf("no request of %s in the audit log %s", agentUser, path)
	}
	return seen
}

// publicPaths are the non-resource paths Kubernetes' default cluster roles
// (system:public-info-viewer, system:discovery) grant every authenticated
// user, which deploy/base/clusterrole.yaml need not repeat.
var publicPaths = []string{"/healthz", "/livez", "/readyz", "/version", "/api", "/apis"}

// unexercisedByAgents are the grants of deploy/base's agent role that a
// run of TestCRDModeKilledNodeGC need not use, each with the code path
// that does. kube-apiserver streams an informer's initial list in its
// watch (client-go's WatchListClient); an API server that cannot falls
// back to a list.
var unexercisedByAgents = map[apiRequest]string{
	{Group: "cilium.io", Resource: "ciliumidentities", Verb: "get"}:   "a create that meets AlreadyExists before the watch delivers the object reads it",
	{Group: "cilium.io", Resource: "ciliumidentities", Verb: "patch"}: "a node adopting a marked identity removes the mark, a walk announces its step over an old mark",
	{Resource: "pods", Verb: "list"}:                                  "the informer's initial list, which this server streams in the watch",
	{Resource: "namespaces", Verb: "list"}:                            "the informer's initial list, which this server streams in the watch",
	{Group: "cilium.io", Resource: "ciliumidentities", Verb: "list"}:  "the cache's initial list, which this server streams in the watch",
	{Group: "identityd.io", Resource: "identitynodes", Verb: "list"}:  "the initial list of the watch of the node's own record, which this server streams in the watch",
}

// unexercisedByManagers is unexercisedByAgents for the manager's role.
var unexercisedByManagers = map[apiRequest]string{
	{Group: "cilium.io", Resource: "ciliumidentities", Verb: "list"}: "the cache's initial list, which this server streams in the watch (the collector decides from the cache)",
}

// checkRoles fails unless acc's roles grant every request of seen, and
// every grant of them was used by seen or is in unexercised.
func checkRoles(t *testing.T, acc deployAccount, seen map[apiRequest]int, unexercised map[apiRequest]string) {
	t.Helper()
	for _, role := range acc.roles {
		for _, r := range role.Rules {
			if len(r.NonResourceURLs) > 0 || len(r.ResourceNames) > 0 ||
				slices.Contains(r.APIGroups, "*") || slices.Contains(r.Resources, "*") || slices.Contains(r.Verbs, "*") {
				t.Errorf("deploy/base role %s: rule %+v grants more than (group, resource, verb) triples", role.Name, r)
			}
		}
	}
	granted := acc.grants()
	var sent []string
	for r, n := range seen {
		sent = append(sent, fmt.Sprintf("%s (%d)", r, n))
		if r.Resource == "" {
			public := slices.ContainsFunc(publicPaths, func(p string) bool { return r.Path == p || strings.HasPrefix(r.Path, p+"/") })
			if !public || r.Verb != "get" {
				t.Errorf("%s sent %s, which no default role grants", acc.user, r)
			}
			continue
		}
		if !granted[r] {
			t.Errorf("%s sent %s, which deploy/base's roles do not grant it", acc.user, r)
		}
	}
	sort.Strings(sent)
	t.Logf("requests of %s: %s", acc.user, strings.Join(sent, ", "))
	for r := range granted {
		if seen[r] == 0 {
			if why, ok := unexercised[r]; ok {
				t.Logf("granted to %s, not used in this run: %s (%s)", acc.user, r, why)
				continue
			}
			t.Errorf("deploy/base's roles grant %s to %s, which it never sent", r, acc.user)
		}
	}
}
