package main

import (
	"bufio"
	"encoding/json"
	"fmt"
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

	"github.com/identityd/identityd/internal/k8stest"
)

// TestCRDModeKilledNodeGC runs two agent processes in crd mode with a short
// IdentityNode lease and GC period; one of them collects
// (identityd_crd_identity_gc_leader), and it is the one killed with
// SIGKILL: the live node takes the collection over within one IdentityNode
// lease, and once the killed node's lease ended its garbage collection
// marks the identities only the killed node used (and the one the live
// node released), deletes them once their marks are a heartbeat timeout
// old (the test dates the marks back rather than wait), keeps the one the
// live node uses, and deletes the dead node's IdentityNode. The agents run as deploy/base's ServiceAccount, with
// a token of it from TokenRequest, on a kube-apiserver whose RBAC
// authorizer has deploy/base's roles and bindings, with deploy/crds
// installed first as an administrator does. The API server's audit
// log of the run is then checked against that ClusterRole: every (group,
// resource, verb) the agents sent is granted, and every grant was used or is
// explained.
func TestCRDModeKilledNodeGC(t *testing.T) {
	waitingParallel(t)
	if testing.Short() {
		t.Skip("runs an API server and agent processes for minutes")
	}
	dir := t.TempDir()
	srv, auditLog := auditedServer(t)
	objs := newAPIObjects(t, srv)
	// The CRDs of deploy/crds, which an administrator installs: the
	// agents only read them.
	k8stest.InstallCRD(t, srv.RESTConfig(), findObject[*apiextensionsv1.CustomResourceDefinition](t, buildDeploy(t, "crds"), "CustomResourceDefinition")...)
	kubeconfig, agentUser := applyDeployRBAC(t, srv, nil)

	// No Cilium agent runs here: --identity-gc-cilium-agents=false allows
	// the 2m timeout that keeps the run within minutes.
	gcFlags := []string{"--identity-node-lease-ttl=25s", "--identity-gc-interval=3s",
		"--identity-heartbeat-timeout=2m", "--identity-gc-cilium-agents=false", "--identity-restore-grace-period=1s",
		deployLeaseNamespace(agentUser)}
	agents := map[string]*healthAgent{
		"node-a": startCRDAgent(t, filepath.Join(dir, "a"), kubeconfig, "node-a", gcFlags...),
		"node-b": startCRDAgent(t, filepath.Join(dir, "b"), kubeconfig, "node-b", gcFlags...),
	}
	const leaderSeries = "identityd_crd_identity_gc_leader"
	collectors := func() []string {
		var out []string
		for name, a := range agents {
			if v, _ := a.metricValue(leaderSeries); v == 1 {
				out = append(out, name)
			}
		}
		return out
	}
	// b is the collector, the node killed; a the node that lives.
	var aName, bName string
	waitUntil(t, time.Minute, "exactly one node collects", func() error {
		c := collectors()
		if len(c) != 1 {
			return fmt.Errorf("collectors %v", c)
		}
		bName = c[0]
		return nil
	})
	aName = "node-a"
	if bName == aName {
		aName = "node-b"
	}
	a, b := agents[aName], agents[bName]
	shA, shB := a.dial(), b.dial()
	defer shA.Close()

	onlyB := allocate(t, shB, "k8s:app=only-b")
	shared := allocate(t, shB, "k8s:app=shared")
	if got := allocate(t, shA, "k8s:app=shared"); got != shared {
		t.Fatalf("%s got %d for the label set %s holds as %d", aName, got, bName, shared)
	}
	released := allocate(t, shA, "k8s:app=released")
	if out, err := shA.Run(time.Now().Add(time.Minute), "identity/release", strconv.Itoa(released)); err != nil {
		t.Fatalf("release: %v %s", err, out)
	}
	waitUntil(t, 30*time.Second, "the killed node's IdentityNode lists its identities", func() error {
		for _, id := range []int{onlyB, shared} {
			if err := objs.lists(bName, id, true)(); err != nil {
				return err
			}
		}
		return nil
	})
	shB.Close()
	b.stop(syscall.SIGKILL)
	killed := time.Now()
	delete(agents, bName)
	// The election's lease is 0.4 of the IdentityNode lease and
	// candidates look every eighth of it: a takeover within the
	// IdentityNode lease (25s), and room for a loaded machine.
	waitUntil(t, 25*time.Second+15*time.Second, "the live node collects", func() error {
		if c := collectors(); len(c) != 1 {
			return fmt.Errorf("collectors %v", c)
		}
		return nil
	})
	t.Logf("%s collects %s after SIGKILL of %s", aName, time.Since(killed).Round(100*time.Millisecond), bName)

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
	waitUntil(t, 2*time.Minute, "the GC deletes the dead node's IdentityNode", func() error {
		if _, ok := objs.nodeIdentities(bName); ok {
			return fmt.Errorf("IdentityNode %s still exists", bName)
		}
		return nil
	})
	if err := objs.lists(aName, shared, true)(); err != nil {
		t.Error(err)
	}
	// The live node allocates the freed label set again.
	again := allocate(t, shA, "k8s:app=only-b")
	if objs.identity(again)["k8s:app"] != "only-b" {
		t.Errorf("CiliumIdentity %d of the reallocated label set is missing", again)
	}

	checkClusterRole(t, agentRequests(t, auditLog, agentUser))
	for r, n := range refusedRequests(t, auditLog, agentUser) {
		t.Errorf("deploy/base's roles refused %s to the agents %d times", r, n)
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

// unexercised are the grants of deploy/base/clusterrole.yaml that a run of
// TestCRDModeKilledNodeGC need not use, each with the code path that does.
var unexercised = map[apiRequest]string{
	{Group: "cilium.io", Resource: "ciliumidentities", Verb: "get"}: "a create that meets AlreadyExists before the watch delivers the object reads it",
	// kube-apiserver streams an informer's initial list in its watch
	// (client-go's WatchListClient); an API server that cannot falls back
	// to a list.
	{Resource: "pods", Verb: "list"}:                                 "the informer's initial list, which this server streams in the watch",
	{Resource: "namespaces", Verb: "list"}:                           "the informer's initial list, which this server streams in the watch",
	{Group: "cilium.io", Resource: "ciliumidentities", Verb: "list"}: "the cache's initial list, which this server streams in the watch (the collector decides from the cache)",
}

// checkClusterRole fails unless deploy/base's roles (clusterrole.yaml,
// role.yaml) grant every request of seen, and every grant of them was used
// by seen or is in unexercised.
func checkClusterRole(t *testing.T, seen map[apiRequest]int) {
	t.Helper()
	roles, _, _ := deployRBAC(t)
	granted := map[apiRequest]bool{}
	for _, role := range roles {
		for _, r := range role.Rules {
			if len(r.NonResourceURLs) > 0 || len(r.ResourceNames) > 0 ||
				slices.Contains(r.APIGroups, "*") || slices.Contains(r.Resources, "*") || slices.Contains(r.Verbs, "*") {
				t.Errorf("deploy/base role %s: rule %+v grants more than (group, resource, verb) triples", role.Name, r)
			}
			for _, g := range r.APIGroups {
				for _, res := range r.Resources {
					for _, v := range r.Verbs {
						granted[apiRequest{Group: g, Resource: res, Verb: v}] = true
					}
				}
			}
		}
	}
	var sent []string
	for r, n := range seen {
		sent = append(sent, fmt.Sprintf("%s (%d)", r, n))
		if r.Resource == "" {
			public := slices.ContainsFunc(publicPaths, func(p string) bool { return r.Path == p || strings.HasPrefix(r.Path, p+"/") })
			if !public || r.Verb != "get" {
				t.Errorf("the agent sent %s, which no default role grants", r)
			}
			continue
		}
		if !granted[r] {
			t.Errorf("the agent sent %s, which deploy/base's roles do not grant", r)
		}
	}
	sort.Strings(sent)
	t.Logf("requests of the agents: %s", strings.Join(sent, ", "))
	for r := range granted {
		if seen[r] == 0 {
			if why, ok := unexercised[r]; ok {
				t.Logf("granted, not used in this run: %s (%s)", r, why)
				continue
			}
			t.Errorf("deploy/base's roles grant %s, which the agent never sent", r)
		}
	}
}
