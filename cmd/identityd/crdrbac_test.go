package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/internal/crdclient"
	"github.com/identityd/identityd/internal/k8stest"
)

// deployResources are the resources of the kinds of deploy/base that
// applyDeployRBAC applies: the account and what authorizes it.
var deployResources = map[string]schema.GroupVersionResource{
	"Namespace":          {Version: "v1", Resource: "namespaces"},
	"ServiceAccount":     {Version: "v1", Resource: "serviceaccounts"},
	"ClusterRole":        {Group: rbacv1.GroupName, Version: "v1", Resource: "clusterroles"},
	"ClusterRoleBinding": {Group: rbacv1.GroupName, Version: "v1", Resource: "clusterrolebindings"},
	"Role":               {Group: rbacv1.GroupName, Version: "v1", Resource: "roles"},
	"RoleBinding":        {Group: rbacv1.GroupName, Version: "v1", Resource: "rolebindings"},
}

// auditedServer starts an API server that writes every request's
// metadata (user, verb, resource, answer) to an audit log, whose path it
// returns.
func auditedServer(t *testing.T) (*k8stest.Server, string) {
	t.Helper()
	dir := t.TempDir()
	auditLog := filepath.Join(dir, "audit.log")
	policy := filepath.Join(dir, "audit-policy.yaml")
	if err := os.WriteFile(policy, []byte("apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n- level: Metadata\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return k8stest.Start(t, k8stest.WithServerArgs("--audit-log-path", auditLog, "--audit-policy-file", policy)), auditLog
}

// applyDeployRBAC applies deploy/<root>'s Namespace, ServiceAccounts,
// ClusterRoles, Roles and their bindings to srv as an administrator's
// `kubectl apply -k` does (the workloads, which the tests run as
// processes, left out), with the rules of each role first passed through
// edit (nil: as written). It waits until the server's RBAC authorizer
// grants each account what its roles say, and returns the accounts of
// deployAccounts, each with a kubeconfig holding a token of it from the
// server's TokenRequest, as the pods have.
func applyDeployRBAC(t *testing.T, srv *k8stest.Server, root string, edit func(role string, rules []rbacv1.PolicyRule) []rbacv1.PolicyRule) map[string]deployAccount {
	t.Helper()
	dyn, err := dynamic.NewForConfig(srv.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range buildDeploy(t, root) {
		gvr, ok := deployResources[o.kind]
		if !ok {
			continue
		}
		switch r := o.obj.(type) {
		case *rbacv1.ClusterRole:
			r = r.DeepCopy()
			if edit != nil {
				r.Rules = edit(r.Name, r.Rules)
			}
			o.obj = r
		case *rbacv1.Role:
			r = r.DeepCopy()
			if edit != nil {
				r.Rules = edit(r.Name, r.Rules)
			}
			o.obj = r
		}
		m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(o.obj)
		if err != nil {
			t.Fatal(err)
		}
		u := &unstructured.Unstructured{Object: m}
		u.SetAPIVersion(o.apiVersion)
		u.SetKind(o.kind)
		_, err = dyn.Resource(gvr).Namespace(u.GetNamespace()).Create(t.Context(), u, metav1.CreateOptions{})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatalf("applying %s: %v", o.key(), err)
		}
	}
	accounts := deployAccounts(t, root)
	for kind, a := range accounts {
		for _, role := range a.roles {
			if edit != nil {
				role.Rules = edit(role.Name, role.Rules)
			}
			// The authorizer reads roles and bindings from its
			// informers: wait until it grants the account each rule,
			// asked as the workload would be.
			for _, r := range role.Rules {
				for _, g := range r.APIGroups {
					for _, res := range r.Resources {
						for _, v := range r.Verbs {
							waitUntil(t, 30*time.Second, fmt.Sprintf("RBAC grants %s %s.%s to %s", v, res, g, a.user), func() error {
								return accessAllowed(t, dyn, a.user, a.namespace(), g, res, v)
							})
						}
					}
				}
			}
		}
		_, name, _ := strings.Cut(strings.TrimPrefix(a.user, "system:serviceaccount:"+a.namespace()), ":")
		req := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
			"metadata": map[string]any{"name": name, "namespace": a.namespace()},
			"spec":     map[string]any{"expirationSeconds": int64(3600)},
		}}
		tr, err := dyn.Resource(deployResources["ServiceAccount"]).Namespace(a.namespace()).Create(t.Context(), req, metav1.CreateOptions{}, "token")
		if err != nil {
			t.Fatalf("TokenRequest for %s: %v", a.user, err)
		}
		token, _, _ := unstructured.NestedString(tr.Object, "status", "token")
		if token == "" {
			t.Fatalf("TokenRequest for %s gave no token", a.user)
		}
		a.kubeconfig = tokenKubeconfig(t, srv, token)
		accounts[kind] = a
	}
	return accounts
}

// accessAllowed asks srv's authorizer (a SubjectAccessReview) whether the
// ServiceAccount user of namespace ns may send verb on resource.group in
// ns.
func accessAllowed(t *testing.T, dyn dynamic.Interface, user, ns, group, resource, verb string) error {
	sar := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
		"spec": map[string]any{
			"user":   user,
			"groups": []any{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"},
			"resourceAttributes": map[string]any{
				"namespace": ns, "verb": verb, "group": group, "resource": resource,
			},
		},
	}}
	got, err := dyn.Resource(schema.GroupVersionResource{Group: "authorization.k8s.io", Version: "v1", Resource: "subjectaccessreviews"}).
		Create(t.Context(), sar, metav1.CreateOptions{})
	if err != nil {
		return err
	}
	if ok, _, _ := unstructured.NestedBool(got.Object, "status", "allowed"); !ok {
		return fmt.Errorf("not allowed: %v", got.Object["status"])
	}
	return nil
}

// tokenKubeconfig writes a kubeconfig that authenticates to srv with a
// bearer token, as a pod's ServiceAccount token does.
func tokenKubeconfig(t *testing.T, srv *k8stest.Server, token string) string {
	t.Helper()
	ca, err := os.ReadFile(srv.CAFile())
	if err != nil {
		t.Fatal(err)
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["k8stest"] = &clientcmdapi.Cluster{Server: srv.URL(), CertificateAuthorityData: ca}
	cfg.AuthInfos["sa"] = &clientcmdapi.AuthInfo{Token: token}
	cfg.Contexts["k8stest"] = &clientcmdapi.Context{Cluster: "k8stest", AuthInfo: "sa"}
	cfg.CurrentContext = "k8stest"
	path := filepath.Join(t.TempDir(), "sa.kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
	return path
}

// refusedRequests reads the requests of user that the server refused
// (403) from its audit log, with their number.
func refusedRequests(t *testing.T, auditLog, user string) map[apiRequest]int {
	t.Helper()
	f, err := os.Open(auditLog)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	refused := map[apiRequest]int{}
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
			ResponseStatus *struct {
				Code int `json:"code"`
			} `json:"responseStatus"`
		}
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			t.Fatalf("audit log: %v", err)
		}
		if ev.User.Username != user || ev.Stage != "ResponseComplete" || ev.ResponseStatus == nil || ev.ResponseStatus.Code != 403 {
			continue
		}
		r := apiRequest{Verb: ev.Verb}
		if ev.ObjectRef != nil && ev.ObjectRef.Resource != "" {
			r.Group, r.Resource = ev.ObjectRef.APIGroup, ev.ObjectRef.Resource
		} else {
			r.Path, _, _ = strings.Cut(ev.RequestURI, "?")
		}
		refused[r]++
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return refused
}

// withoutVerb returns an edit for applyDeployRBAC that takes verb on
// resource out of every rule that grants it (a rule left with no verb
// goes).
func withoutVerb(resource, verb string) func(string, []rbacv1.PolicyRule) []rbacv1.PolicyRule {
	return func(_ string, rules []rbacv1.PolicyRule) []rbacv1.PolicyRule {
		var out []rbacv1.PolicyRule
		for _, r := range rules {
			r = *r.DeepCopy()
			if slices.Contains(r.Resources, resource) {
				r.Verbs = slices.DeleteFunc(r.Verbs, func(v string) bool { return v == verb })
			}
			if len(r.Verbs) > 0 {
				out = append(out, r)
			}
		}
		return out
	}
}

// TestCRDModeAgentOnlyReadsCRDs runs the agent as deploy/base's
// ServiceAccount, with a token of it from the API server's TokenRequest as
// in its pods, against a kube-apiserver whose RBAC authorizer has
// deploy/base's roles and bindings. With the CRDs missing, the agent is
// refused the create and its start fails naming the missing CRD and the
// right; with deploy/crds installed but one CRD outdated, it is refused
// the update and the start fails naming it; with deploy/crds current, as
// an administrator installs them, it starts and allocates, refused
// nothing.
func TestCRDModeAgentOnlyReadsCRDs(t *testing.T) {
	parallelProcess(t)
	if testing.Short() {
		t.Skip("runs an API server and agent processes")
	}
	srv, auditLog := auditedServer(t)
	agent := applyDeployRBAC(t, srv, "base", nil)["agent"]
	kubeconfig, saUser := agent.kubeconfig, agent.user
	startToExit := func(want ...string) {
		t.Helper()
		out, err := runAgentToExit(t, append([]string{"--state-dir", t.TempDir(), "--ipcache-map", "file",
			"--prometheus-serve-addr", "", "--log-level", "error"}, crdAgentArgs(kubeconfig, "node-sa", "--identity-gc-interval=0")...)...)
		if err == nil {
			t.Fatalf("the agent started, want its start refused naming %q:\n%s", want, out)
		}
		for _, w := range want {
			if !strings.Contains(out, w) {
				t.Fatalf("the agent's start failed: %v, want an error naming %q:\n%s", err, want, out)
			}
		}
	}
	crdRefusals := func(verb string) int {
		return refusedRequests(t, auditLog, saUser)[apiRequest{Group: "apiextensions.k8s.io", Resource: "customresourcedefinitions", Verb: verb}]
	}

	// No CRD installed: the agent may not create one.
	startToExit(crdstore.CiliumIdentityCRDName, `"create" on customresourcedefinitions.apiextensions.k8s.io`)
	if crdRefusals("create") == 0 {
		t.Errorf("no create of a CRD was refused to %s: %v", saUser, refusedRequests(t, auditLog, saUser))
	}

	// deploy/crds with the IdentityNode CRD of an older schema: the agent
	// may not update it.
	crds := findObject[*apiextensionsv1.CustomResourceDefinition](t, buildDeploy(t, "crds"), "CustomResourceDefinition")
	var current *apiextensionsv1.CustomResourceDefinition
	for _, crd := range crds {
		crd = crd.DeepCopy()
		if crd.Name == crdstore.IdentityNodeCRDName {
			current = crd.DeepCopy()
			crd.Labels = map[string]string{"identityd.io/crd-schema-version": "0.0.1"}
		}
		k8stest.InstallCRD(t, srv.RESTConfig(), crd)
	}
	if current == nil {
		t.Fatalf("deploy/crds has no %s", crdstore.IdentityNodeCRDName)
	}
	startToExit(crdstore.IdentityNodeCRDName, `"update" on customresourcedefinitions.apiextensions.k8s.io`)
	if crdRefusals("update") == 0 {
		t.Errorf("no update of a CRD was refused to %s: %v", saUser, refusedRequests(t, auditLog, saUser))
	}

	// The administrator brings it up to date from deploy/crds.
	cli, err := crdclient.New(srv.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	old, err := cli.Get(t.Context(), current.Name)
	if err != nil {
		t.Fatal(err)
	}
	old.Labels, old.Spec = current.Labels, current.Spec
	if _, err := cli.Update(t.Context(), old); err != nil {
		t.Fatal(err)
	}
	countRefusals := func() int {
		n := 0
		for _, c := range refusedRequests(t, auditLog, saUser) {
			n += c
		}
		return n
	}
	refusedBefore := countRefusals()
	sa := startCRDAgent(t, filepath.Join(t.TempDir(), "sa"), kubeconfig, "node-sa", "--identity-gc-interval=0")
	sh := sa.dial()
	id := allocate(t, sh, "k8s:app=deployed")
	sh.Close()
	waitUntil(t, 30*time.Second, "the IdentityNode is written as the ServiceAccount", newAPIObjects(t, srv).lists("node-sa", id, true))
	sa.stop(syscall.SIGTERM)
	if countRefusals() != refusedBefore {
		t.Errorf("deploy/base's roles refused the agent with the CRDs installed: %v", refusedRequests(t, auditLog, saUser))
	}
}

// TestCRDModeAgentNeedsItsRoleRules: deploy/base's roles with one rule
// the agent needs taken out (the get of the CRDs, which the agent checks
// at start) leave the agent refused by the server's authorizer: its start
// fails naming the request, and the server's audit log shows the 403.
func TestCRDModeAgentNeedsItsRoleRules(t *testing.T) {
	parallelProcess(t)
	if testing.Short() {
		t.Skip("runs an API server and agent processes")
	}
	srv, auditLog := auditedServer(t)
	k8stest.InstallCRD(t, srv.RESTConfig(), findObject[*apiextensionsv1.CustomResourceDefinition](t, buildDeploy(t, "crds"), "CustomResourceDefinition")...)
	agent := applyDeployRBAC(t, srv, "base", withoutVerb("customresourcedefinitions", "get"))["agent"]
	kubeconfig, saUser := agent.kubeconfig, agent.user
	out, err := runAgentToExit(t, append([]string{"--state-dir", t.TempDir(), "--ipcache-map", "file",
		"--prometheus-serve-addr", "", "--log-level", "error"}, crdAgentArgs(kubeconfig, "node-sa", "--identity-gc-interval=0")...)...)
	if err == nil {
		t.Fatalf("the agent started without the right to read the CRDs:\n%s", out)
	}
	if !strings.Contains(out, `"get" on customresourcedefinitions.apiextensions.k8s.io`) {
		t.Errorf("the agent's error does not name the refused get of the CRDs:\n%s", out)
	}
	if n := refusedRequests(t, auditLog, saUser)[apiRequest{Group: "apiextensions.k8s.io", Resource: "customresourcedefinitions", Verb: "get"}]; n == 0 {
		t.Errorf("the server refused no get of a CRD to %s: %v", saUser, refusedRequests(t, auditLog, saUser))
	}
}

// TestCRDModeCollectorNeedsLeaseRole: without deploy/base's Role on the
// identity manager's Leases (its create taken out), the server refuses the
// manager the collector's Lease: the manager runs, but does not collect.
// With the Role as written, the manager collects and the Lease in its
// namespace names it.
func TestCRDModeCollectorNeedsLeaseRole(t *testing.T) {
	parallelProcess(t)
	if testing.Short() {
		t.Skip("runs an API server and manager processes")
	}
	const leaderSeries = "identityd_crd_identity_gc_leader"
	for _, c := range []struct {
		name string
		edit func(string, []rbacv1.PolicyRule) []rbacv1.PolicyRule
	}{{"without create on leases", withoutVerb("leases", "create")}, {"as written", nil}} {
		t.Run(c.name, func(t *testing.T) {
			srv, auditLog := auditedServer(t)
			k8stest.InstallCRD(t, srv.RESTConfig(), findObject[*apiextensionsv1.CustomResourceDefinition](t, buildDeploy(t, "crds"), "CustomResourceDefinition")...)
			manager := applyDeployRBAC(t, srv, "base", c.edit)["manager"]
			ns := manager.namespace()
			m := startManager(t, filepath.Join(t.TempDir(), "m"), crdAgentArgs(manager.kubeconfig, "manager-a",
				"--identity-gc-interval=3s", "--identity-heartbeat-timeout=2m", "--identity-gc-cilium-agents=false",
				"--identity-gc-lease-namespace="+ns)...)
			m.waitFor("/readyz", http.StatusOK, 90*time.Second)
			leases := newLeaseClient(t, srv)
			if c.edit == nil {
				waitUntil(t, time.Minute, "the manager collects", func() error {
					if v, _ := m.metricValue(leaderSeries); v != 1 {
						return fmt.Errorf("%s = %v", leaderSeries, v)
					}
					return nil
				})
				lease, err := leases.Namespace(ns).Get(t.Context(), "identity-gc-0", metav1.GetOptions{})
				if err != nil {
					t.Fatal(err)
				}
				if h, _, _ := unstructured.NestedString(lease.Object, "spec", "holderIdentity"); !strings.HasPrefix(h, "manager-a"+"_") {
					t.Errorf("the Lease %s/identity-gc-0 names %q, want manager-a", ns, h)
				}
				return
			}
			refused := apiRequest{Group: "coordination.k8s.io", Resource: "leases", Verb: "create"}
			waitUntil(t, time.Minute, "the server refuses the manager the Lease", func() error {
				if n := refusedRequests(t, auditLog, manager.user)[refused]; n == 0 {
					return fmt.Errorf("no refused %s yet", refused)
				}
				return nil
			})
			// Three collection intervals: it never collects.
			time.Sleep(9 * time.Second)
			if v, _ := m.metricValue(leaderSeries); v != 0 {
				t.Errorf("the manager collects without the right to the Lease: %s = %v", leaderSeries, v)
			}
			if code, body := m.probe("/healthz"); code != http.StatusOK {
				t.Errorf("the manager refused its Lease is not live: %d %s", code, body)
			}
			m.stop(syscall.SIGTERM)
		})
	}
}

// newLeaseClient is an admin client of srv's Leases.
func newLeaseClient(t *testing.T, srv *k8stest.Server) dynamic.NamespaceableResourceInterface {
	t.Helper()
	dyn, err := dynamic.NewForConfig(srv.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	return dyn.Resource(schema.GroupVersionResource{Group: "coordination.k8s.io", Version: "v1", Resource: "leases"})
}
