package k8stest_test

import (
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/k8stest"
)

var widgets = schema.GroupVersionResource{Group: "test.identityd.io", Version: "v1", Resource: "widgets"}

// widgetCRD is a tiny cluster-scoped CRD: objects with a string field.
func widgetCRD() *apiextensionsv1.CustomResourceDefinition {
	return &apiextensionsv1.CustomResourceDefinition{
		ObjectMeta: metav1.ObjectMeta{Name: widgets.Resource + "." + widgets.Group},
		Spec: apiextensionsv1.CustomResourceDefinitionSpec{
			Group: widgets.Group,
			Scope: apiextensionsv1.ClusterScoped,
			Names: apiextensionsv1.CustomResourceDefinitionNames{
				Plural: widgets.Resource, Singular: "widget", Kind: "Widget", ListKind: "WidgetList",
			},
			Versions: []apiextensionsv1.CustomResourceDefinitionVersion{{
				Name: widgets.Version, Served: true, Storage: true,
				Schema: &apiextensionsv1.CustomResourceValidation{OpenAPIV3Schema: &apiextensionsv1.JSONSchemaProps{
					Type: "object",
					Properties: map[string]apiextensionsv1.JSONSchemaProps{
						"color": {Type: "string"},
					},
				}},
			}},
		},
	}
}

func widget(name, color string) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": widgets.Group + "/" + widgets.Version,
		"kind":       "Widget",
		"metadata":   map[string]any{"name": name},
		"color":      color,
	}}
}

func widgetClient(t testing.TB, cfg *rest.Config) dynamic.ResourceInterface {
	t.Helper()
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return dyn.Resource(widgets)
}

func createWidget(t testing.TB, cli dynamic.ResourceInterface, name, color string) {
	t.Helper()
	if _, err := cli.Create(t.Context(), widget(name, color), metav1.CreateOptions{}); err != nil {
		t.Fatalf("creating widget %s: %v", name, err)
	}
}

func getColor(t testing.TB, cli dynamic.ResourceInterface, name string) string {
	t.Helper()
	got, err := cli.Get(t.Context(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("getting widget %s: %v", name, err)
	}
	color, _, _ := unstructured.NestedString(got.Object, "color")
	return color
}

func TestCreateAndGet(t *testing.T) {
	t.Parallel()
	s := k8stest.Start(t)
	k8stest.InstallCRD(t, s.RESTConfig(), widgetCRD())
	cli := widgetClient(t, s.RESTConfig())

	// InstallCRD waits out the server's delay of creates on a CRD that
	// was just established (2s), so the first create is fast.
	start := time.Now()
	createWidget(t, cli, "w1", "red")
	if d := time.Since(start); d >= 2*time.Second {
		t.Errorf("first create took %s, the server's delay on a new CRD was not waited out", d)
	}
	if got := getColor(t, cli, "w1"); got != "red" {
		t.Errorf("color = %q, want red", got)
	}
	// The server validates objects against the CRD's schema.
	bad := widget("w2", "red")
	bad.Object["color"] = 42
	if _, err := cli.Create(t.Context(), bad, metav1.CreateOptions{}); !apierrors.IsInvalid(err) {
		t.Errorf("creating a widget with a number for color: err = %v, want Invalid", err)
	}
	// Installing the same CRD again is a no-op.
	k8stest.InstallCRD(t, s.RESTConfig(), widgetCRD())
}

func TestRestartKeepsClientsAndData(t *testing.T) {
	t.Parallel()
	s := k8stest.Start(t)
	k8stest.InstallCRD(t, s.RESTConfig(), widgetCRD())
	cli := widgetClient(t, s.RESTConfig())
	createWidget(t, cli, "before", "blue")
	url := s.URL()

	s.Restart(t)
	if s.URL() != url {
		t.Fatalf("URL changed on restart: %s -> %s", url, s.URL())
	}
	if got := getColor(t, cli, "before"); got != "blue" {
		t.Errorf("after restart: color = %q, want blue", got)
	}
	createWidget(t, cli, "after", "green")

	// A kubeconfig written before the restart still works.
	fromFile := kubeconfigClient(t, s.Kubeconfig())
	if got := getColor(t, fromFile, "after"); got != "green" {
		t.Errorf("through the kubeconfig: color = %q, want green", got)
	}
}

func TestKill(t *testing.T) {
	t.Parallel()
	s := k8stest.Start(t)
	k8stest.InstallCRD(t, s.RESTConfig(), widgetCRD())
	cli := widgetClient(t, s.RESTConfig())
	createWidget(t, cli, "w", "red")

	s.Kill(t)
	if s.Running() {
		t.Fatal("running after Kill")
	}
	if _, err := cli.Get(t.Context(), "w", metav1.GetOptions{}); err == nil {
		t.Fatal("get succeeded on a killed server")
	}
	// Killed, it comes back with its data, which is in etcd.
	s.Restart(t)
	if got := getColor(t, cli, "w"); got != "red" {
		t.Errorf("after kill and restart: color = %q, want red", got)
	}
}

func TestOtherUserForbidden(t *testing.T) {
	t.Parallel()
	s := k8stest.Start(t)
	k8stest.InstallCRD(t, s.RESTConfig(), widgetCRD())
	createWidget(t, widgetClient(t, s.RESTConfig()), "w", "red")

	for _, path := range []string{s.Kubeconfig(), s.UserKubeconfig(t, "alice", "developers")} {
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("%s: mode %v, want 0600", path, fi.Mode().Perm())
		}
	}
	admin := kubeconfigClient(t, s.Kubeconfig())
	if got := getColor(t, admin, "w"); got != "red" {
		t.Errorf("admin: color = %q, want red", got)
	}
	alice := kubeconfigClient(t, s.UserKubeconfig(t, "alice", "developers"))
	_, err := alice.Get(t.Context(), "w", metav1.GetOptions{})
	if !apierrors.IsForbidden(err) {
		t.Fatalf("alice get: err = %v, want Forbidden", err)
	}
	if _, err := alice.Create(t.Context(), widget("x", "red"), metav1.CreateOptions{}); !apierrors.IsForbidden(err) {
		t.Fatalf("alice create: err = %v, want Forbidden", err)
	}
	// The group is what the server authorizes.
	root := kubeconfigClient(t, s.UserKubeconfig(t, "root", "system:masters"))
	if got := getColor(t, root, "w"); got != "red" {
		t.Errorf("user in system:masters: color = %q, want red", got)
	}
}

func TestTwoServersOneEtcd(t *testing.T) {
	t.Parallel()
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	a := k8stest.Start(t, k8stest.WithEtcd(etcd.Endpoints()...))
	b := k8stest.Start(t, k8stest.WithEtcd(etcd.Endpoints()...))
	if a.URL() == b.URL() {
		t.Fatalf("both servers on %s", a.URL())
	}
	if a.Etcd()[0] != etcd.Endpoints()[0] || b.Etcd()[0] != etcd.Endpoints()[0] {
		t.Fatalf("etcd endpoints %v and %v, want %v", a.Etcd(), b.Etcd(), etcd.Endpoints())
	}
	for _, s := range []*k8stest.Server{a, b} {
		k8stest.InstallCRD(t, s.RESTConfig(), widgetCRD())
	}
	ca, cb := widgetClient(t, a.RESTConfig()), widgetClient(t, b.RESTConfig())
	createWidget(t, ca, "w", "red")
	createWidget(t, cb, "w", "blue")
	if got := getColor(t, ca, "w"); got != "red" {
		t.Errorf("server a: color = %q, want red", got)
	}
	if got := getColor(t, cb, "w"); got != "blue" {
		t.Errorf("server b: color = %q, want blue", got)
	}
}

func kubeconfigClient(t testing.TB, path string) dynamic.ResourceInterface {
	t.Helper()
	cfg, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		t.Fatal(err)
	}
	return widgetClient(t, cfg)
}

// BenchmarkBareCreate is the physical baseline of the server: creates of
// new tiny objects, sequential and from 8 goroutines.
func BenchmarkBareCreate(b *testing.B) {
	s := k8stest.Start(b)
	cfg := s.RESTConfig()
	k8stest.InstallCRD(b, cfg, widgetCRD())
	newWidget := func(n uint64) *unstructured.Unstructured { return widget(strconv.FormatUint(n, 10), "red") }
	for _, g := range []int{1, 8} {
		b.Run(fmt.Sprintf("goroutines=%d", g), func(b *testing.B) {
			k8stest.BenchCreate(b, cfg, widgets, newWidget, g)
		})
	}
}
