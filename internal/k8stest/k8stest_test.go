package k8stest_test

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/eventually"
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

// startWithWidgets starts a server with the widget CRD installed, and
// returns an admin client of widgets.
func startWithWidgets(t testing.TB) (*k8stest.Server, dynamic.ResourceInterface) {
	t.Helper()
	s := k8stest.Start(t)
	k8stest.InstallCRD(t, s.RESTConfig(), widgetCRD())
	return s, widgetClient(t, s.RESTConfig())
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

// wantColor checks the color of widget name, read through cli; what says
// which read it is.
func wantColor(t testing.TB, cli dynamic.ResourceInterface, name, want, what string) {
	t.Helper()
	got, err := cli.Get(t.Context(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("%s: getting widget %s: %v", what, name, err)
	}
	if color, _, _ := unstructured.NestedString(got.Object, "color"); color != want {
		t.Errorf("%s: widget %s has color %q, want %q", what, name, color, want)
	}
}

func TestCreateAndGet(t *testing.T) {
	t.Parallel()
	s, cli := startWithWidgets(t)

	// InstallCRD waits out the server's delay of creates on a CRD that
	// was just established (2s), so the first create is fast.
	start := time.Now()
	createWidget(t, cli, "w1", "red")
	if d := time.Since(start); d >= 2*time.Second {
		t.Errorf("first create took %s, the server's delay on a new CRD was not waited out", d)
	}
	wantColor(t, cli, "w1", "red", "after create")
	// The server validates objects against the CRD's schema.
	bad := widget("w2", "red")
	bad.Object["color"] = 42
	if _, err := cli.Create(t.Context(), bad, metav1.CreateOptions{}); !apierrors.IsInvalid(err) {
		t.Errorf("creating a widget with a number for color: err = %v, want Invalid", err)
	}
	// Discovery finds the CRD's resource the way client-go's discovery
	// does without aggregated discovery: /api, /apis, then each group
	// version's resources.
	var core metav1.APIVersions
	if err := k8stest.GetJSON(t.Context(), s.RESTConfig(), "/api", &core); err != nil {
		t.Fatalf("discovery: %v", err)
	}
	var groups metav1.APIGroupList
	if err := k8stest.GetJSON(t.Context(), s.RESTConfig(), "/apis", &groups); err != nil {
		t.Fatalf("discovery: %v", err)
	}
	found := false
	for _, g := range groups.Groups {
		for _, v := range g.Versions {
			var list metav1.APIResourceList
			if err := k8stest.GetJSON(t.Context(), s.RESTConfig(), "/apis/"+v.GroupVersion, &list); err != nil {
				t.Fatalf("discovery: %v", err)
			}
			for _, r := range list.APIResources {
				found = found || list.GroupVersion == widgets.GroupVersion().String() && r.Name == widgets.Resource
			}
		}
	}
	if !found {
		t.Errorf("discovery did not find %s in %+v", widgets, groups)
	}
	// The server's metrics count requests, for tests that count them.
	metrics, err := k8stest.GetRaw(t.Context(), s.RESTConfig(), "/metrics")
	if err != nil {
		t.Fatalf("metrics: %v", err)
	}
	if !strings.Contains(string(metrics), `apiserver_request_total{code="201",component="apiserver",dry_run="",group="test.identityd.io"`) {
		t.Errorf("metrics do not count the create of a widget:\n%.2000s", metrics)
	}
	// Installing the same CRD again is a no-op.
	k8stest.InstallCRD(t, s.RESTConfig(), widgetCRD())
}

func TestRestartKeepsClientsAndData(t *testing.T) {
	t.Parallel()
	s, cli := startWithWidgets(t)
	createWidget(t, cli, "before", "blue")
	url := s.URL()

	s.Restart(t)
	if s.URL() != url {
		t.Fatalf("URL changed on restart: %s -> %s", url, s.URL())
	}
	wantColor(t, cli, "before", "blue", "after restart")
	createWidget(t, cli, "after", "green")

	// A kubeconfig written before the restart still works.
	fromFile := kubeconfigClient(t, s.Kubeconfig())
	wantColor(t, fromFile, "after", "green", "through the kubeconfig")
}

func TestKill(t *testing.T) {
	t.Parallel()
	s, cli := startWithWidgets(t)
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
	wantColor(t, cli, "w", "red", "after kill and restart")
}

func TestEtcdKilledUnderServer(t *testing.T) {
	t.Parallel()
	s, cli := startWithWidgets(t)
	createWidget(t, cli, "before", "red")
	// Killed rather than stopped: etcd's graceful stop waits seconds for
	// the server's open streams.
	s.EtcdCluster().Member(0).Kill()
	s.EtcdCluster().Member(0).Restart()
	// The server reconnects to etcd; requests in between may fail.
	eventually.True(t, "a create after etcd restarted", func() bool {
		_, err := cli.Create(t.Context(), widget("after", "blue"), metav1.CreateOptions{})
		return err == nil
	})
	wantColor(t, cli, "before", "red", "after etcd restarted")
}

func TestOtherUserForbidden(t *testing.T) {
	t.Parallel()
	s, cli := startWithWidgets(t)
	createWidget(t, cli, "w", "red")

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
	wantColor(t, admin, "w", "red", "admin")
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
	wantColor(t, root, "w", "red", "user in system:masters")
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
	wantColor(t, ca, "w", "red", "server a")
	wantColor(t, cb, "w", "blue", "server b")
}

// fatalTB records the first fatal error of what it is passed to instead of
// failing the test.
type fatalTB struct {
	testing.TB
	msg string
}

func (f *fatalTB) Fatal(args ...any) { f.msg = fmt.Sprint(args...); runtime.Goexit() }
func (f *fatalTB) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

func TestStartFailureShowsLog(t *testing.T) {
	t.Parallel()
	tb := &fatalTB{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		k8stest.Start(tb, k8stest.WithServerArgs("--no-such-flag"))
		t.Error("Start returned for a server that cannot start")
	}()
	<-done
	if !strings.Contains(tb.msg, "exited before serving") || !strings.Contains(tb.msg, "unknown flag: --no-such-flag") {
		t.Errorf("Start failed with %q, want the server's exit and its log", tb.msg)
	}
}

func TestStopEndsWatches(t *testing.T) {
	t.Parallel()
	s, cli := startWithWidgets(t)
	w, err := cli.Watch(t.Context(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	createWidget(t, cli, "w", "red")
	if ev := <-w.ResultChan(); ev.Type != watch.Added {
		t.Fatalf("first event %v, want Added", ev.Type)
	}
	// The server ends open watches when it stops instead of waiting for
	// them (up to a minute) or being killed by Stop after its grace period
	// (30 s). Only the stop is timed: the start after it reads the whole
	// API from etcd, which on a loaded machine alone took 30 s.
	start := time.Now()
	s.Stop(t)
	if d := time.Since(start); d > 20*time.Second {
		t.Errorf("stop with a watch open took %s", d)
	}
	s.Restart(t)
	select {
	case _, ok := <-w.ResultChan():
		for ok {
			_, ok = <-w.ResultChan()
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the watch did not end when the server restarted")
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

// TestSharedOutlivesTestsAndStartsEmpty: the server of Shared is the same
// across tests, outlives the test that started it, keeps its CRDs and
// namespaces, and has no custom object, Pod or Lease (but the server's own
// leases) when a test gets it.
func TestSharedOutlivesTestsAndStartsEmpty(t *testing.T) {
	var first *k8stest.Server
	t.Run("first", func(t *testing.T) {
		first = k8stest.Shared(t)
		k8stest.InstallCRD(t, first.RESTConfig(), widgetCRD())
		cli := widgetClient(t, first.RESTConfig())
		createWidget(t, cli, "left-over", "red")
		createWidget(t, cli, "another", "blue")
		admin, err := dynamic.NewForConfig(first.RESTConfig())
		if err != nil {
			t.Fatal(err)
		}
		create(t, admin, namespaces, object("v1", "Namespace", "", "work", nil))
		create(t, admin, pods, podObject("work", "web", "node-1"))
		create(t, admin, leases, leaseObject("work", "lock", "node-1"))
		create(t, admin, leases, leaseObject("default", "lock", "node-1"))
		create(t, admin, leases, leaseObject("kube-system", "lock", "node-1"))
	})
	t.Run("second", func(t *testing.T) {
		srv := k8stest.Shared(t)
		if srv != first {
			t.Fatal("a second server was started")
		}
		if !srv.Running() {
			t.Fatal("the server ended with the test that started it")
		}
		cli := widgetClient(t, srv.RESTConfig())
		list, err := cli.List(t.Context(), metav1.ListOptions{})
		if err != nil {
			t.Fatalf("the CRD is gone: %v", err)
		}
		if len(list.Items) != 0 {
			t.Fatalf("%d widgets left from the first test", len(list.Items))
		}
		createWidget(t, cli, "left-over", "green")
		wantColor(t, cli, "left-over", "green", "a new widget of an old name")
		admin, err := dynamic.NewForConfig(srv.RESTConfig())
		if err != nil {
			t.Fatal(err)
		}
		for _, gvr := range []schema.GroupVersionResource{pods, leases} {
			left, err := admin.Resource(gvr).List(t.Context(), metav1.ListOptions{})
			if err != nil {
				t.Fatal(err)
			}
			for _, obj := range left.Items {
				if _, own := obj.GetLabels()["apiserver.kubernetes.io/identity"]; !own {
					t.Errorf("%s %s/%s left from the first test", gvr.Resource, obj.GetNamespace(), obj.GetName())
				}
			}
		}
		// The namespace stays: there is no controller to finish deleting one.
		create(t, admin, leases, leaseObject("work", "lock", "node-2"))
	})
}

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(stopSharedAfter{m})
}

// stopSharedAfter runs the tests and then stops the shared API server, so
// that goleak finds the goroutines of the tests and not those of the server
// they share.
type stopSharedAfter struct{ m *testing.M }

func (s stopSharedAfter) Run() int {
	code := s.m.Run()
	k8stest.StopShared()
	return code
}
