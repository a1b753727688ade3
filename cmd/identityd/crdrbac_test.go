package main

import (
	"encoding/json"
	"maps"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/internal/crdclient"
	"github.com/identityd/identityd/internal/k8stest"
)

// clusterAuth is the authentication and authorization webhook of a test
// API server (internal/k8stest's has no core API, so neither RBAC objects
// nor ServiceAccount tokens of its own). It answers TokenReviews from a
// table of bearer tokens, as the token authenticator of a cluster does
// for ServiceAccount tokens, and SubjectAccessReviews by evaluating
// ClusterRoles and ClusterRoleBindings the way RBAC does (verbs, API
// groups, resources and resource names; "*"; User, Group and
// ServiceAccount subjects), plus the public paths Kubernetes' default roles
// give every authenticated user. So a test runs the agent as the
// ServiceAccount of deploy/base, with the token of a pod, and only what
// deploy/base's binding grants it is allowed.
type clusterAuth struct {
	roles    map[string]rbacv1.ClusterRole
	bindings []rbacv1.ClusterRoleBinding
	tokens   map[string]authUser
	// kubeconfig points the API server's --authentication-kubeconfig and
	// --authorization-kubeconfig at the webhook.
	kubeconfig string

	mu     sync.Mutex
	denied map[apiRequest][]string // request -> users refused it
}

type authUser struct {
	Username string   `json:"username"`
	UID      string   `json:"uid,omitempty"`
	Groups   []string `json:"groups,omitempty"`
}

// serviceAccountUser is how a cluster authenticates a token of
// ServiceAccount namespace/name.
func serviceAccountUser(namespace, name string) authUser {
	return authUser{
		Username: "system:serviceaccount:" + namespace + ":" + name,
		UID:      "uid-" + namespace + "-" + name,
		Groups:   []string{"system:serviceaccounts", "system:serviceaccounts:" + namespace, "system:authenticated"},
	}
}

func startClusterAuth(t *testing.T, roles []rbacv1.ClusterRole, bindings []rbacv1.ClusterRoleBinding, tokens map[string]authUser) *clusterAuth {
	t.Helper()
	a := &clusterAuth{roles: map[string]rbacv1.ClusterRole{}, bindings: bindings, tokens: tokens, denied: map[apiRequest][]string{}}
	for _, r := range roles {
		a.roles[r.Name] = r
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(a.serve)}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	a.kubeconfig = filepath.Join(t.TempDir(), "auth.kubeconfig")
	kc := "apiVersion: v1\nkind: Config\nclusters:\n- name: auth\n  cluster:\n    server: http://" + ln.Addr().String() +
		"\nusers:\n- name: apiserver\n  user: {}\ncontexts:\n- name: auth\n  context: {cluster: auth, user: apiserver}\ncurrent-context: auth\n"
	if err := os.WriteFile(a.kubeconfig, []byte(kc), 0o600); err != nil {
		t.Fatal(err)
	}
	return a
}

// serverArgs are the API server flags that make it ask the webhook.
func (a *clusterAuth) serverArgs() k8stest.Option {
	return k8stest.WithServerArgs("--authorization-kubeconfig", a.kubeconfig, "--authentication-kubeconfig", a.kubeconfig)
}

func (a *clusterAuth) serve(w http.ResponseWriter, req *http.Request) {
	var review struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
		Spec       struct {
			// TokenReview
			Token     string   `json:"token,omitempty"`
			Audiences []string `json:"audiences,omitempty"`
			// SubjectAccessReview
			User               string   `json:"user,omitempty"`
			Groups             []string `json:"groups,omitempty"`
			ResourceAttributes *struct {
				Verb, Group, Resource, Subresource, Name string
			} `json:"resourceAttributes,omitempty"`
			NonResourceAttributes *struct {
				Verb, Path string
			} `json:"nonResourceAttributes,omitempty"`
		} `json:"spec"`
		Status map[string]any `json:"status"`
	}
	if err := json.NewDecoder(req.Body).Decode(&review); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	s := review.Spec
	switch review.Kind {
	case "TokenReview":
		if u, ok := a.tokens[s.Token]; ok {
			review.Status = map[string]any{"authenticated": true, "user": u, "audiences": s.Audiences}
		} else {
			review.Status = map[string]any{"authenticated": false, "error": "unknown token"}
		}
	case "SubjectAccessReview":
		allowed := false
		switch {
		case slices.Contains(s.Groups, "system:masters"):
			allowed = true
		case s.ResourceAttributes != nil:
			r := s.ResourceAttributes
			allowed = a.allows(s.User, s.Groups, r.Verb, r.Group, r.Resource, r.Subresource, r.Name)
			if !allowed {
				a.mu.Lock()
				k := apiRequest{Group: r.Group, Resource: r.Resource, Verb: r.Verb}
				a.denied[k] = append(a.denied[k], s.User)
				a.mu.Unlock()
			}
		case s.NonResourceAttributes != nil:
			p := s.NonResourceAttributes.Path
			allowed = s.NonResourceAttributes.Verb == "get" &&
				slices.ContainsFunc(publicPaths, func(pub string) bool { return p == pub || strings.HasPrefix(p, pub+"/") })
		}
		review.Status = map[string]any{"allowed": allowed}
		if !allowed {
			review.Status["reason"] = "no ClusterRoleBinding of the test grants it"
		}
	default:
		http.Error(w, "unknown review kind "+review.Kind, http.StatusBadRequest)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(review)
}

// allows evaluates the bindings as RBAC's authorizer does.
func (a *clusterAuth) allows(user string, groups []string, verb, group, resource, subresource, name string) bool {
	if subresource != "" {
		resource += "/" + subresource
	}
	for _, b := range a.bindings {
		if b.RoleRef.Kind != "ClusterRole" || !slices.ContainsFunc(b.Subjects, func(s rbacv1.Subject) bool {
			switch s.Kind {
			case rbacv1.UserKind:
				return s.Name == user
			case rbacv1.GroupKind:
				return slices.Contains(groups, s.Name)
			case rbacv1.ServiceAccountKind:
				return user == "system:serviceaccount:"+s.Namespace+":"+s.Name
			}
			return false
		}) {
			continue
		}
		for _, r := range a.roles[b.RoleRef.Name].Rules {
			if matchesRBAC(r.Verbs, verb) && matchesRBAC(r.APIGroups, group) && matchesRBAC(r.Resources, resource) &&
				(len(r.ResourceNames) == 0 || slices.Contains(r.ResourceNames, name)) {
				return true
			}
		}
	}
	return false
}

func matchesRBAC(list []string, v string) bool {
	return slices.Contains(list, rbacv1.ResourceAll) || slices.Contains(list, v)
}

// deniedRequests returns what the webhook refused, by request.
func (a *clusterAuth) deniedRequests() map[apiRequest][]string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return maps.Clone(a.denied)
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

// crdRequestsRefused counts, by verb, the requests on CRDs the webhook
// refused to user.
func crdRequestsRefused(a *clusterAuth, user string) map[string]int {
	n := map[string]int{}
	for r, users := range a.deniedRequests() {
		if r.Group == "apiextensions.k8s.io" && r.Resource == "customresourcedefinitions" {
			for _, u := range users {
				if u == user {
					n[r.Verb]++
				}
			}
		}
	}
	return n
}

// TestCRDModeAgentOnlyReadsCRDs runs the agent as deploy/base's
// ServiceAccount, with a bearer token as in its pods, against an API
// server whose authorizer evaluates deploy/base's ClusterRole and
// ClusterRoleBinding. With the CRDs missing, the agent is refused the
// create and its start fails naming the missing CRD and the right; with
// deploy/crds installed but one CRD outdated, it is refused the update and
// the start fails naming it; with deploy/crds current, as an
// administrator installs them, it starts and allocates, refused nothing.
func TestCRDModeAgentOnlyReadsCRDs(t *testing.T) {
	parallelProcess(t)
	if testing.Short() {
		t.Skip("runs an API server and agent processes")
	}
	roles, bindings, saUser := deployRBAC(t)
	ns, name, _ := strings.Cut(strings.TrimPrefix(saUser, "system:serviceaccount:"), ":")
	const saToken = "token-of-the-deploy-service-account"
	auth := startClusterAuth(t, roles, bindings, map[string]authUser{saToken: serviceAccountUser(ns, name)})
	srv := k8stest.Start(t, auth.serverArgs())
	kubeconfig := tokenKubeconfig(t, srv, saToken)
	startToExit := func(want ...string) {
		t.Helper()
		out, err := runAgentToExit(t, append([]string{"--state-dir", t.TempDir(), "--ipcache-map", "file",
			"--prometheus-serve-addr", "", "--log-level", "error"}, crdAgentArgs(kubeconfig, "node-sa")...)...)
		if err == nil {
			t.Fatalf("the agent started, want its start refused naming %q:\n%s", want, out)
		}
		for _, w := range want {
			if !strings.Contains(out, w) {
				t.Fatalf("the agent's start failed: %v, want an error naming %q:\n%s", err, want, out)
			}
		}
	}

	// No CRD installed: the agent may not create one.
	startToExit(crdstore.CiliumIdentityCRDName, `"create" on customresourcedefinitions.apiextensions.k8s.io`)
	if n := crdRequestsRefused(auth, saUser); n["create"] == 0 {
		t.Errorf("no create of a CRD was refused to %s: %v", saUser, n)
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
	if n := crdRequestsRefused(auth, saUser); n["update"] == 0 {
		t.Errorf("no update of a CRD was refused to %s: %v", saUser, n)
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
	refusals := func() int {
		n := 0
		for _, users := range auth.deniedRequests() {
			n += len(users)
		}
		return n
	}
	refusedBefore := refusals()
	sa := startCRDAgent(t, filepath.Join(t.TempDir(), "sa"), kubeconfig, "node-sa")
	sh := sa.dial()
	id := allocate(t, sh, "k8s:app=deployed")
	sh.Close()
	waitUntil(t, 30*time.Second, "the IdentityNode is written as the ServiceAccount", newAPIObjects(t, srv).lists("node-sa", id, true))
	sa.stop(syscall.SIGTERM)
	if refusals() != refusedBefore {
		t.Errorf("deploy/base's role refused the agent with the CRDs installed: %v", auth.deniedRequests())
	}
}
