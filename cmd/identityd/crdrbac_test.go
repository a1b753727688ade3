package main

import (
	"encoding/json"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/internal/k8stest"
)

// roleAuthorizer is an authorization webhook for the API server: it
// answers its SubjectAccessReviews from rules, as RBAC would for a user
// bound to a ClusterRole of those rules (and the default roles' public
// paths), so that a test runs the agent as a user with a role.
type roleAuthorizer struct {
	rules      map[apiRequest]bool
	kubeconfig string
}

func startRoleAuthorizer(t *testing.T, rules []apiRequest) *roleAuthorizer {
	t.Helper()
	a := &roleAuthorizer{rules: map[apiRequest]bool{}}
	for _, r := range rules {
		a.rules[r] = true
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(a.serve)}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	a.kubeconfig = filepath.Join(t.TempDir(), "authz.kubeconfig")
	kc := "apiVersion: v1\nkind: Config\nclusters:\n- name: authz\n  cluster:\n    server: http://" + ln.Addr().String() +
		"\nusers:\n- name: apiserver\n  user: {}\ncontexts:\n- name: authz\n  context: {cluster: authz, user: apiserver}\ncurrent-context: authz\n"
	if err := os.WriteFile(a.kubeconfig, []byte(kc), 0o600); err != nil {
		t.Fatal(err)
	}
	return a
}

func (a *roleAuthorizer) serve(w http.ResponseWriter, req *http.Request) {
	var review struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
		Spec       struct {
			Groups             []string `json:"groups"`
			ResourceAttributes *struct {
				Verb, Group, Resource string
			} `json:"resourceAttributes"`
			NonResourceAttributes *struct {
				Verb, Path string
			} `json:"nonResourceAttributes"`
		} `json:"spec"`
		Status struct {
			Allowed bool   `json:"allowed"`
			Reason  string `json:"reason,omitempty"`
		} `json:"status"`
	}
	if err := json.NewDecoder(req.Body).Decode(&review); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	switch s := review.Spec; {
	case slices.Contains(s.Groups, "system:masters"):
		review.Status.Allowed = true
	case s.ResourceAttributes != nil:
		r := s.ResourceAttributes
		review.Status.Allowed = a.rules[apiRequest{Group: r.Group, Resource: r.Resource, Verb: r.Verb}]
	case s.NonResourceAttributes != nil:
		p := s.NonResourceAttributes.Path
		review.Status.Allowed = s.NonResourceAttributes.Verb == "get" &&
			slices.ContainsFunc(publicPaths, func(pub string) bool { return p == pub || strings.HasPrefix(p, pub+"/") })
	}
	if !review.Status.Allowed {
		review.Status.Reason = "not in the test's role"
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(review)
}

// roleWithoutCRDWrites is docs/k8s/clusterrole.yaml's role but for the
// writes of CRDs: what a cluster gives identityd when its administrator
// installs the CRDs.
var roleWithoutCRDWrites = []apiRequest{
	{Group: "cilium.io", Resource: "ciliumidentities", Verb: "get"},
	{Group: "cilium.io", Resource: "ciliumidentities", Verb: "list"},
	{Group: "cilium.io", Resource: "ciliumidentities", Verb: "watch"},
	{Group: "cilium.io", Resource: "ciliumidentities", Verb: "create"},
	{Group: "cilium.io", Resource: "ciliumidentities", Verb: "patch"},
	{Group: "cilium.io", Resource: "ciliumidentities", Verb: "delete"},
	{Group: "identityd.io", Resource: "identitynodes", Verb: "get"},
	{Group: "identityd.io", Resource: "identitynodes", Verb: "list"},
	{Group: "identityd.io", Resource: "identitynodes", Verb: "create"},
	{Group: "identityd.io", Resource: "identitynodes", Verb: "patch"},
	{Group: "identityd.io", Resource: "identitynodes", Verb: "delete"},
	{Group: "identityd.io", Resource: "identityleases", Verb: "get"},
	{Group: "identityd.io", Resource: "identityleases", Verb: "create"},
	{Group: "identityd.io", Resource: "identityleases", Verb: "update"},
	{Group: "apiextensions.k8s.io", Resource: "customresourcedefinitions", Verb: "get"},
}

// TestCRDModeWithoutCRDRights runs the agent as a user whose role may read
// but not create CRDs. With the CRDs missing, the start fails with an
// error naming the missing CRD and the right it lacks; once an
// administrator installed them, the same user starts and allocates.
func TestCRDModeWithoutCRDRights(t *testing.T) {
	if testing.Short() {
		t.Skip("runs an API server and agent processes")
	}
	authz := startRoleAuthorizer(t, roleWithoutCRDWrites)
	srv := k8stest.Start(t, k8stest.WithServerArgs("--authorization-kubeconfig", authz.kubeconfig))
	kubeconfig := srv.UserKubeconfig(t, "identityd-no-crd-rights")

	out, err := runAgentToExit(t, append([]string{"--state-dir", t.TempDir(), "--ipcache-map", "file",
		"--prometheus-serve-addr", "", "--log-level", "error"}, crdAgentArgs(kubeconfig, "node-a")...)...)
	if err == nil || !strings.Contains(out, crdstore.CiliumIdentityCRDName) || !strings.Contains(out, `"create" on customresourcedefinitions.apiextensions.k8s.io`) {
		t.Fatalf("start without the right to create the missing CRDs: %v, want an error naming %s and the missing right:\n%s",
			err, crdstore.CiliumIdentityCRDName, out)
	}

	k8stest.InstallCRD(t, srv.RESTConfig(), crdstore.CiliumIdentityCRD())
	k8stest.InstallCRD(t, srv.RESTConfig(), crdstore.IdentityNodeCRD())
	k8stest.InstallCRD(t, srv.RESTConfig(), crdstore.IdentityLeaseCRD())
	a := startCRDAgent(t, filepath.Join(t.TempDir(), "a"), kubeconfig, "node-a")
	sh := a.dial()
	defer sh.Close()
	id := allocate(t, sh, "k8s:app=web")
	waitUntil(t, 30*time.Second, "the IdentityNode is written under the role", newAPIObjects(t, srv).lists("node-a", id, true))
}
