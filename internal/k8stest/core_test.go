package k8stest_test

import (
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"

	"github.com/identityd/identityd/internal/eventually"
	"github.com/identityd/identityd/internal/k8stest"
)

var (
	namespaces      = schema.GroupVersionResource{Version: "v1", Resource: "namespaces"}
	pods            = schema.GroupVersionResource{Version: "v1", Resource: "pods"}
	leases          = schema.GroupVersionResource{Group: "coordination.k8s.io", Version: "v1", Resource: "leases"}
	serviceAccounts = schema.GroupVersionResource{Version: "v1", Resource: "serviceaccounts"}
	roles           = schema.GroupVersionResource{Group: "rbac.authorization.k8s.io", Version: "v1", Resource: "roles"}
	roleBindings    = schema.GroupVersionResource{Group: "rbac.authorization.k8s.io", Version: "v1", Resource: "rolebindings"}
)

func object(apiVersion, kind, namespace, name string, fields map[string]any) *unstructured.Unstructured {
	obj := map[string]any{
		"apiVersion": apiVersion,
		"kind":       kind,
		"metadata":   map[string]any{"name": name, "namespace": namespace},
	}
	for k, v := range fields {
		obj[k] = v
	}
	return &unstructured.Unstructured{Object: obj}
}

func create(t *testing.T, dyn dynamic.Interface, gvr schema.GroupVersionResource, obj *unstructured.Unstructured) *unstructured.Unstructured {
	t.Helper()
	got, err := dyn.Resource(gvr).Namespace(obj.GetNamespace()).Create(t.Context(), obj, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("creating %s %s/%s: %v", gvr.Resource, obj.GetNamespace(), obj.GetName(), err)
	}
	return got
}

func leaseObject(namespace, name, holder string) *unstructured.Unstructured {
	return object("coordination.k8s.io/v1", "Lease", namespace, name, map[string]any{
		"spec": map[string]any{"holderIdentity": holder, "leaseDurationSeconds": int64(15)},
	})
}

func podObject(namespace, name, node string) *unstructured.Unstructured {
	return object("v1", "Pod", namespace, name, map[string]any{
		"spec": map[string]any{
			"nodeName":           node,
			"serviceAccountName": "app",
			"containers":         []any{map[string]any{"name": "c", "image": "app:1"}},
		},
	})
}

// TestCoreAPIAndServiceAccountTokens: the server serves the core API
// (namespaces; pods bound to a node, whose status a client writes; leases;
// service accounts), issues service account tokens (TokenRequest) that
// authenticate, and authorizes with RBAC: a token's account may do what a
// role bound to it grants, and nothing else.
func TestCoreAPIAndServiceAccountTokens(t *testing.T) {
	t.Parallel()
	s := k8stest.Start(t)
	admin, err := dynamic.NewForConfig(s.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	// A namespaced object needs its namespace.
	if _, err := admin.Resource(leases).Namespace("apps").Create(t.Context(), leaseObject("apps", "early", "a"), metav1.CreateOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("creating a lease in a namespace that does not exist: err = %v, want NotFound", err)
	}
	create(t, admin, namespaces, object("v1", "Namespace", "", "apps", nil))
	create(t, admin, serviceAccounts, object("v1", "ServiceAccount", "apps", "app", nil))
	pod := create(t, admin, pods, podObject("apps", "web", "node-1"))
	unstructured.SetNestedSlice(pod.Object, []any{map[string]any{"ip": "10.1.0.7"}}, "status", "podIPs")
	unstructured.SetNestedField(pod.Object, "10.1.0.7", "status", "podIP")
	if _, err := admin.Resource(pods).Namespace("apps").UpdateStatus(t.Context(), pod, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("writing the pod's IPs: %v", err)
	}
	onNode, err := admin.Resource(pods).List(t.Context(), metav1.ListOptions{FieldSelector: "spec.nodeName=node-1"})
	if err != nil || len(onNode.Items) != 1 {
		t.Fatalf("pods of node-1: %v, %v", onNode, err)
	}
	if ip, _, _ := unstructured.NestedString(onNode.Items[0].Object, "status", "podIP"); ip != "10.1.0.7" {
		t.Errorf("pod IP %q, want 10.1.0.7", ip)
	}
	create(t, admin, leases, leaseObject("apps", "lock", "node-1"))

	// A token of the account, as a pod's projected token is.
	req := object("authentication.k8s.io/v1", "TokenRequest", "apps", "app", map[string]any{
		"spec": map[string]any{"expirationSeconds": int64(3600)},
	})
	tr, err := admin.Resource(serviceAccounts).Namespace("apps").Create(t.Context(), req, metav1.CreateOptions{}, "token")
	if err != nil {
		t.Fatalf("TokenRequest: %v", err)
	}
	token, _, _ := unstructured.NestedString(tr.Object, "status", "token")
	if token == "" {
		t.Fatalf("TokenRequest gave no token: %v", tr.Object)
	}
	cfg := &rest.Config{Host: s.URL(), BearerToken: token, TLSClientConfig: rest.TLSClientConfig{CAFile: s.CAFile()}}
	app, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := app.Resource(leases).Namespace("apps").Get(t.Context(), "lock", metav1.GetOptions{}); !apierrors.IsForbidden(err) {
		t.Fatalf("the account read a lease no role grants: err = %v, want Forbidden", err)
	}
	create(t, admin, roles, object("rbac.authorization.k8s.io/v1", "Role", "apps", "leases", map[string]any{
		"rules": []any{map[string]any{"apiGroups": []any{"coordination.k8s.io"}, "resources": []any{"leases"}, "verbs": []any{"get"}}},
	}))
	create(t, admin, roleBindings, object("rbac.authorization.k8s.io/v1", "RoleBinding", "apps", "leases", map[string]any{
		"roleRef":  map[string]any{"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "leases"},
		"subjects": []any{map[string]any{"kind": "ServiceAccount", "name": "app", "namespace": "apps"}},
	}))
	// The authorizer reads roles from its informers: a moment later.
	eventually.Within(t, 30*time.Second, "the account reads the lease its role grants", func() bool {
		_, err := app.Resource(leases).Namespace("apps").Get(t.Context(), "lock", metav1.GetOptions{})
		return err == nil
	})
	if err := app.Resource(leases).Namespace("apps").Delete(t.Context(), "lock", metav1.DeleteOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("the account deleted a lease its role only lets it read: err = %v, want Forbidden", err)
	}
}
