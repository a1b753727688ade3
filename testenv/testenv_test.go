package testenv_test

import (
	"os"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/internal/k8stest"
	"github.com/identityd/identityd/testenv"
)

func TestEtcd(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcd(t)
	if len(e.Endpoints()) != 1 || e.ClientConfig().Endpoints[0] != e.Endpoints()[0] {
		t.Fatalf("endpoints %v, the client config's %v", e.Endpoints(), e.ClientConfig().Endpoints)
	}
	cli, err := clientv3.New(e.ClientConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	if _, err := cli.Put(t.Context(), "k", "v"); err != nil {
		t.Fatal(err)
	}
	resp, err := e.Client(t).Get(t.Context(), "k")
	if err != nil || len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "v" {
		t.Fatalf("get: %v %v", resp, err)
	}
}

// TestAPIServer: the server passes /readyz, which identityd's client asks
// at start, for the kubeconfig's user as for the REST config's; it serves
// the CRD store's objects, and keeps them in the etcd given.
func TestAPIServer(t *testing.T) {
	t.Parallel()
	etcd := testenv.StartEtcd(t)
	api := testenv.StartAPIServer(t, testenv.WithEtcd(etcd))
	if api.Etcd() != etcd {
		t.Fatal("Etcd() is not the etcd given with WithEtcd")
	}
	fi, err := os.Stat(api.KubeconfigPath())
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("kubeconfig mode %v, want 0600", fi.Mode().Perm())
	}
	fromFile, err := clientcmd.BuildConfigFromFlags("", api.KubeconfigPath())
	if err != nil {
		t.Fatal(err)
	}
	if fromFile.Host != api.URL() {
		t.Errorf("the kubeconfig's server is %s, want %s", fromFile.Host, api.URL())
	}
	for name, cfg := range map[string]*rest.Config{"kubeconfig": fromFile, "REST config": api.RESTConfig()} {
		body, err := k8stest.GetRaw(t.Context(), cfg, "/readyz")
		if err != nil || string(body) != "ok" {
			t.Errorf("%s: /readyz = %q, %v; want ok", name, body, err)
		}
		dyn, err := dynamic.NewForConfig(cfg)
		if err != nil {
			t.Fatal(err)
		}
		for _, gvr := range []schema.GroupVersionResource{crdstore.CiliumIdentityResource, crdstore.IdentityNodeResource, crdstore.IdentityLeaseResource} {
			if _, err := dyn.Resource(gvr).List(t.Context(), metav1.ListOptions{}); err != nil {
				t.Errorf("%s: listing %s: %v", name, gvr.Resource, err)
			}
		}
	}
	resp, err := etcd.Client(t).Get(t.Context(), "/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		t.Fatal(err)
	}
	if resp.Count == 0 {
		t.Error("the API server keeps nothing in the etcd given")
	}

	// A restarted server is ready again for the clients made before.
	api.Restart(t)
	dyn, err := dynamic.NewForConfig(fromFile)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := dyn.Resource(crdstore.CiliumIdentityResource).List(t.Context(), metav1.ListOptions{}); err != nil {
		t.Errorf("after the restart: %v", err)
	}
}

func TestWithoutCRDs(t *testing.T) {
	t.Parallel()
	api := testenv.StartAPIServer(t, testenv.WithoutCRDs())
	dyn, err := dynamic.NewForConfig(api.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	_, err = dyn.Resource(crdstore.CiliumIdentityResource).List(t.Context(), metav1.ListOptions{})
	if !apierrors.IsNotFound(err) {
		t.Errorf("listing CiliumIdentity objects without the CRDs: %v, want NotFound", err)
	}
}
