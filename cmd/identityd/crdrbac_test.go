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
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/identityd/identityd/cells/allocator/crdstore"
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

// withoutCRDWrites is role without create and update on CRDs: what a
// cluster gives identityd when its administrator installs the CRDs
// (deploy/crds).
func withoutCRDWrites(role rbacv1.ClusterRole) rbacv1.ClusterRole {
	role = *role.DeepCopy()
	for i, r := range role.Rules {
		if slices.Contains(r.Resources, "customresourcedefinitions") {
			role.Rules[i].Verbs = slices.DeleteFunc(r.Verbs, func(v string) bool { return v == "create" || v == "update" })
		}
	}
	return role
}

// TestCRDModeWithoutCRDRights runs the agent against an API server whose
// authorizer evaluates deploy/base's ClusterRole and ClusterRoleBinding.
// First as a user bound to that role without create and update on CRDs:
// with the CRDs missing the start fails with an error naming the missing
// CRD and the right it lacks. Then as deploy/base's ServiceAccount, with a
// bearer token as in its pods: the agent registers the CRDs itself and
// allocates, and the webhook refused none of its requests. Then the first
// user again, the CRDs now installed: it starts and allocates.
func TestCRDModeWithoutCRDRights(t *testing.T) {
	parallelProcess(t)
	if testing.Short() {
		t.Skip("runs an API server and agent processes")
	}
	roles, bindings, saUser := deployRBAC(t)
	if len(roles) != 1 {
		t.Fatalf("deploy/base has %d ClusterRoles, want 1", len(roles))
	}
	limited := withoutCRDWrites(roles[0])
	limited.Name = "identityd-no-crd-writes"
	roles = append(roles, limited)
	bindings = append(bindings, rbacv1.ClusterRoleBinding{
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: limited.Name},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.UserKind, Name: "identityd-no-crd-rights"}},
	})
	ns, name, _ := strings.Cut(strings.TrimPrefix(saUser, "system:serviceaccount:"), ":")
	const saToken = "token-of-the-deploy-service-account"
	auth := startClusterAuth(t, roles, bindings, map[string]authUser{saToken: serviceAccountUser(ns, name)})
	srv := k8stest.Start(t, auth.serverArgs())
	kubeconfig := srv.UserKubeconfig(t, "identityd-no-crd-rights")

	out, err := runAgentToExit(t, append([]string{"--state-dir", t.TempDir(), "--ipcache-map", "file",
		"--prometheus-serve-addr", "", "--log-level", "error"}, crdAgentArgs(kubeconfig, "node-a")...)...)
	if err == nil || !strings.Contains(out, crdstore.CiliumIdentityCRDName) || !strings.Contains(out, `"create" on customresourcedefinitions.apiextensions.k8s.io`) {
		t.Fatalf("start without the right to create the missing CRDs: %v, want an error naming %s and the missing right:\n%s",
			err, crdstore.CiliumIdentityCRDName, out)
	}

	// The ServiceAccount of deploy/base registers the CRDs and allocates.
	sa := startCRDAgent(t, filepath.Join(t.TempDir(), "sa"), tokenKubeconfig(t, srv, saToken), "node-sa")
	shSA := sa.dial()
	idSA := allocate(t, shSA, "k8s:app=deployed")
	shSA.Close()
	waitUntil(t, 30*time.Second, "the IdentityNode is written as the ServiceAccount", newAPIObjects(t, srv).lists("node-sa", idSA, true))
	sa.stop(syscall.SIGTERM)
	for r, users := range auth.deniedRequests() {
		if slices.Contains(users, saUser) {
			t.Errorf("deploy/base's role refused %s to %s", r, saUser)
		}
	}

	for _, crd := range crdstore.CRDs() {
		k8stest.InstallCRD(t, srv.RESTConfig(), crd) // already there: waits until served
	}
	a := startCRDAgent(t, filepath.Join(t.TempDir(), "a"), kubeconfig, "node-a")
	sh := a.dial()
	defer sh.Close()
	id := allocate(t, sh, "k8s:app=web")
	waitUntil(t, 30*time.Second, "the IdentityNode is written under the role", newAPIObjects(t, srv).lists("node-a", id, true))
}
