package crdstore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/k8stest"
)

// ciliumEndpointCRD is Cilium v1.16's CiliumEndpoint CRD, reduced to what
// the API server needs to store the objects as Cilium's agents write them:
// namespaced, cilium.io/v2, no status subresource (the agent creates the
// object with its status), a status of unknown fields kept as written.
func ciliumEndpointCRD() *apiextensionsv1.CustomResourceDefinition {
	preserve := true
	return &apiextensionsv1.CustomResourceDefinition{
		ObjectMeta: metav1.ObjectMeta{Name: "ciliumendpoints." + CiliumGroup},
		Spec: apiextensionsv1.CustomResourceDefinitionSpec{
			Group: CiliumGroup,
			Names: apiextensionsv1.CustomResourceDefinitionNames{
				Kind: "CiliumEndpoint", ListKind: "CiliumEndpointList",
				Plural: "ciliumendpoints", Singular: "ciliumendpoint",
				ShortNames: []string{"cep", "ciliumep"},
			},
			Scope: apiextensionsv1.NamespaceScoped,
			Versions: []apiextensionsv1.CustomResourceDefinitionVersion{{
				Name: CiliumVersion, Served: true, Storage: true,
				Schema: &apiextensionsv1.CustomResourceValidation{OpenAPIV3Schema: &apiextensionsv1.JSONSchemaProps{
					Type:     "object",
					Required: []string{"metadata"},
					Properties: map[string]apiextensionsv1.JSONSchemaProps{
						"apiVersion": {Type: "string"},
						"kind":       {Type: "string"},
						"metadata":   {Type: "object"},
						"status":     {Type: "object", XPreserveUnknownFields: &preserve},
					},
				}},
			}},
		},
	}
}

// ciliumEndpointSliceCRD is Cilium v1.16's CiliumEndpointSlice CRD,
// reduced likewise: cluster-scoped, cilium.io/v2alpha1, a namespace and a
// list of endpoints.
func ciliumEndpointSliceCRD() *apiextensionsv1.CustomResourceDefinition {
	preserve := true
	return &apiextensionsv1.CustomResourceDefinition{
		ObjectMeta: metav1.ObjectMeta{Name: "ciliumendpointslices." + CiliumGroup},
		Spec: apiextensionsv1.CustomResourceDefinitionSpec{
			Group: CiliumGroup,
			Names: apiextensionsv1.CustomResourceDefinitionNames{
				Kind: "CiliumEndpointSlice", ListKind: "CiliumEndpointSliceList",
				Plural: "ciliumendpointslices", Singular: "ciliumendpointslice",
				ShortNames: []string{"ces"},
			},
			Scope: apiextensionsv1.ClusterScoped,
			Versions: []apiextensionsv1.CustomResourceDefinitionVersion{{
				Name: CiliumSliceVersion, Served: true, Storage: true,
				Schema: &apiextensionsv1.CustomResourceValidation{OpenAPIV3Schema: &apiextensionsv1.JSONSchemaProps{
					Type:     "object",
					Required: []string{"endpoints"},
					Properties: map[string]apiextensionsv1.JSONSchemaProps{
						"apiVersion": {Type: "string"},
						"kind":       {Type: "string"},
						"metadata":   {Type: "object"},
						"namespace":  {Type: "string"},
						"endpoints": {Type: "array", Items: &apiextensionsv1.JSONSchemaPropsOrArray{Schema: &apiextensionsv1.JSONSchemaProps{
							Type: "object", XPreserveUnknownFields: &preserve,
						}}},
					},
				}},
			}},
		},
	}
}

// createObject creates the object of the JSON document doc, of resource.
func createObject(t *testing.T, cfg *rest.Config, doc string) {
	t.Helper()
	var u unstructured.Unstructured
	if err := json.Unmarshal([]byte(doc), &u.Object); err != nil {
		t.Fatalf("%v:\n%s", err, doc)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	gvr := CiliumEndpointResource
	if u.GetKind() == "CiliumEndpointSlice" {
		gvr = CiliumEndpointSliceResource
	}
	var ri dynamic.ResourceInterface = dyn.Resource(gvr)
	if ns := u.GetNamespace(); ns != "" {
		ri = dyn.Resource(gvr).Namespace(ns)
		// A namespaced object needs its namespace, which a cluster has
		// before its pods.
		nsObj := &unstructured.Unstructured{Object: map[string]any{"apiVersion": "v1", "kind": "Namespace", "metadata": map[string]any{"name": ns}}}
		_, err := dyn.Resource(schema.GroupVersionResource{Version: "v1", Resource: "namespaces"}).Create(t.Context(), nsObj, metav1.CreateOptions{})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatalf("creating namespace %s: %v", ns, err)
		}
	}
	if _, err := ri.Create(t.Context(), &u, metav1.CreateOptions{}); err != nil {
		t.Fatalf("creating %s %s: %v", u.GetKind(), u.GetName(), err)
	}
}

// ciliumEndpoint is a CiliumEndpoint as a Cilium v1.16 agent writes it
// for pod ns/name, whose endpoint has the identity id of the label set
// app=app.
func ciliumEndpoint(ns, name, app string, id identity.NumericIdentity) string {
	return fmt.Sprintf(`{
  "apiVersion": "cilium.io/v2",
  "kind": "CiliumEndpoint",
  "metadata": {
    "name": %[2]q,
    "namespace": %[1]q,
    "labels": {"app": %[3]q},
    "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": %[2]q, "uid": "6f1c2b3a-0d4e-4a5b-9c7d-%012[4]d"}]
  },
  "status": {
    "id": 1234,
    "identity": {
      "id": %[4]d,
      "labels": [
        "k8s:app=%[3]s",
        "k8s:io.cilium.k8s.namespace.labels.kubernetes.io/metadata.name=%[1]s",
        "k8s:io.cilium.k8s.policy.cluster=default",
        "k8s:io.cilium.k8s.policy.serviceaccount=default",
        "k8s:io.kubernetes.pod.namespace=%[1]s"
      ]
    },
    "networking": {"addressing": [{"ipv4": "10.0.1.17"}], "node": "192.168.0.12"},
    "encryption": {},
    "external-identifiers": {
      "cni-attachment-id": "b1946ac92492:eth0",
      "container-id": "b1946ac92492d2347c6235b4d2611184",
      "k8s-namespace": %[1]q,
      "k8s-pod-name": %[2]q,
      "pod-name": "%[1]s/%[2]s"
    },
    "named-ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    "state": "ready"
  }
}`, ns, name, app, id)
}

// ciliumEndpointSlice is a CiliumEndpointSlice as Cilium v1.16's operator
// writes it: the endpoints of namespace ns, each with its identity.
func ciliumEndpointSlice(name, ns string, ids ...identity.NumericIdentity) string {
	var eps []string
	for i, id := range ids {
		eps = append(eps, fmt.Sprintf(`{
      "name": "pod-%d",
      "id": %d,
      "networking": {"addressing": [{"ipv4": "10.0.2.%d"}], "node": "192.168.0.13"},
      "encryption": {},
      "named-ports": [{"name": "dns", "port": 53, "protocol": "UDP"}]
    }`, i, id, 10+i))
	}
	return fmt.Sprintf(`{
  "apiVersion": "cilium.io/v2alpha1",
  "kind": "CiliumEndpointSlice",
  "metadata": {"name": %q},
  "namespace": %q,
  "endpoints": [%s]
}`, name, ns, strings.Join(eps, ","))
}

// oldMark is a heartbeat mark far older than any timeout of the tests.
func oldMark() string { return time.Now().Add(-time.Hour).UTC().Format(time.RFC3339Nano) }

// TestGCKeepsIdentitiesCiliumEndpointsName: with the shortest heartbeat
// timeout, identities that carry a mark older than it and that no
// IdentityNode lists are kept when a CiliumEndpoint or a
// CiliumEndpointSlice names them (their marks removed), even when the
// object naming them is on a later page of the listing; the unnamed one is
// deleted. Once the CiliumEndpoint is gone, its identity gets a fresh mark
// and is deleted only a timeout later.
func TestGCKeepsIdentitiesCiliumEndpointsName(t *testing.T) {
	srv := serialServer(t)
	cfg := srv.RESTConfig()
	k8stest.InstallCRD(t, cfg, ciliumEndpointCRD(), ciliumEndpointSliceCRD())
	a := startGCNode(t, cfg, "node-a", gcTestConfig)
	a.gc.pageSize = 2

	const (
		byCEP      identity.NumericIdentity = 1001
		byCES      identity.NumericIdentity = 1002
		unnamed    identity.NumericIdentity = 1003
		byCEPClean identity.NumericIdentity = 1004
	)
	createIdentity(t, a.Store, byCEP, mustLabels(t, "k8s:app=by-cep"), oldMark())
	createIdentity(t, a.Store, byCES, mustLabels(t, "k8s:app=by-ces"), oldMark())
	createIdentity(t, a.Store, unnamed, mustLabels(t, "k8s:app=unnamed"), oldMark())
	createIdentity(t, a.Store, byCEPClean, mustLabels(t, "k8s:app=by-cep-clean"), "")
	// Other endpoints first, so that the ones that matter are on the
	// listings' last pages.
	for i := range 4 {
		createObject(t, cfg, ciliumEndpoint("aaa", fmt.Sprintf("other-%d", i), "other", 60000))
		createObject(t, cfg, ciliumEndpointSlice(fmt.Sprintf("ces-aaa-%d", i), "aaa", 60001, 60002))
	}
	createObject(t, cfg, ciliumEndpoint("prod", "web-0", "by-cep", byCEP))
	createObject(t, cfg, ciliumEndpoint("prod", "web-1", "by-cep-clean", byCEPClean))
	createObject(t, cfg, ciliumEndpointSlice("ces-zzz-1", "prod", 60003, byCES))

	res := runGC(t, a.Store)
	if res.Deleted != 1 || res.KeptUsed != 3 || res.Marked != 0 || res.Unmarked != 2 {
		t.Fatalf("run: %+v, want the unnamed identity deleted, three kept as used, two marks removed", res)
	}
	if readIdentity(t, a.Store, unnamed) != nil {
		t.Errorf("identity %d, marked an hour ago and named by nothing, is still there", unnamed)
	}
	for _, id := range []identity.NumericIdentity{byCEP, byCES, byCEPClean} {
		if m, ok := markOf(t, a.Store, id); ok {
			t.Errorf("identity %d, named by a Cilium endpoint object, still carries the mark %q", id, m)
		}
	}
	if got := a.gc.endpoints.servedKinds(); !got["CiliumEndpoint"] || !got["CiliumEndpointSlice"] {
		t.Errorf("served kinds %v, want both", got)
	}

	// The pod of web-0 is gone: its identity is marked now, and deleted
	// only after the timeout.
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := dyn.Resource(CiliumEndpointResource).Namespace("prod").Delete(t.Context(), "web-0", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if res := runGC(t, a.Store); res.Marked != 1 || res.Deleted != 0 {
		t.Fatalf("run after the CiliumEndpoint's deletion: %+v, want one marked and none deleted", res)
	}
	passTimeout(gcTestConfig, a.Store)
	if res := runGC(t, a.Store); res.Deleted != 1 || res.KeptUsed != 2 {
		t.Fatalf("run a timeout later: %+v, want it deleted and two kept", res)
	}
	if readIdentity(t, a.Store, byCEP) != nil {
		t.Errorf("identity %d is still there a timeout after its CiliumEndpoint went", byCEP)
	}
}

// failingPages fails, with a broken connection, the requests of a listing
// of resource that ask for a page after the first, while armed, in every
// transport built from a configuration it wraps (each client the store
// makes builds one, from its own goroutine).
type failingPages struct {
	resource string
	armed    atomic.Bool
	failed   atomic.Int64
}

func (f *failingPages) wrap(next http.RoundTripper) http.RoundTripper {
	return failingTransport{f, next}
}

type failingTransport struct {
	*failingPages
	next http.RoundTripper
}

func (f failingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if f.armed.Load() && strings.HasSuffix(r.URL.Path, "/"+f.resource) && r.URL.Query().Get("continue") != "" {
		f.failed.Add(1)
		return nil, errors.New("network is unreachable")
	}
	return f.next.RoundTrip(r)
}

// TestGCSkipsDeletesOnPartialEndpoints: a listing of CiliumEndpoint
// objects that fails after its first page fails the run before any
// delete or mark, and names the resource; the identity a later page names
// stays. Once listings work again, the run keeps it and deletes the
// unnamed one.
func TestGCSkipsDeletesOnPartialEndpoints(t *testing.T) {
	srv := serialServer(t)
	cfg := srv.RESTConfig()
	k8stest.InstallCRD(t, cfg, ciliumEndpointCRD(), ciliumEndpointSliceCRD())
	fail := &failingPages{resource: "ciliumendpoints"}
	wrapped := rest.CopyConfig(cfg)
	wrapped.Wrap(fail.wrap)
	a := startGCNode(t, wrapped, "node-a", gcTestConfig)
	a.gc.pageSize = 2

	const (
		named   identity.NumericIdentity = 2001
		unnamed identity.NumericIdentity = 2002
	)
	createIdentity(t, a.Store, named, mustLabels(t, "k8s:app=named"), oldMark())
	createIdentity(t, a.Store, unnamed, mustLabels(t, "k8s:app=unnamed"), oldMark())
	for i := range 4 {
		createObject(t, cfg, ciliumEndpoint("aaa", fmt.Sprintf("other-%d", i), "other", 60000))
	}
	createObject(t, cfg, ciliumEndpoint("zzz", "web-0", "named", named))

	fail.armed.Store(true)
	res, err := a.collect(t.Context())
	if err == nil || !errors.Is(err, globalstore.ErrUnavailable) || !strings.Contains(err.Error(), "CiliumEndpoint") {
		t.Fatalf("run with a failing page: %+v, %v; want an unavailable error naming CiliumEndpoint", res, err)
	}
	if fail.failed.Load() == 0 {
		t.Fatal("no page request failed")
	}
	if res.Deleted != 0 || res.Marked != 0 || res.Unmarked != 0 {
		t.Errorf("run with a failing page changed objects: %+v", res)
	}
	for _, id := range []identity.NumericIdentity{named, unnamed} {
		if readIdentity(t, a.Store, id) == nil {
			t.Errorf("identity %d was deleted on a partial listing", id)
		}
	}

	fail.armed.Store(false)
	if res := runGC(t, a.Store); res.Deleted != 1 || res.KeptUsed != 1 {
		t.Fatalf("run with working listings: %+v, want one deleted, one kept", res)
	}
	if readIdentity(t, a.Store, named) == nil || readIdentity(t, a.Store, unnamed) != nil {
		t.Error("the named identity must stay and the unnamed one go")
	}
}

// TestGCWithoutCiliumEndpointCRDs: where neither CRD is installed the
// collection goes on (an unnamed, long-marked identity is deleted), and the
// identity-gc-endpoints health scope says the CRDs are not installed.
func TestGCWithoutCiliumEndpointCRDs(t *testing.T) {
	srv := k8stest.Start(t)
	gc := gcTestConfig
	gc.Interval = time.Hour // the job runs; the test collects by hand
	logged := &infoLog{}
	n := startElectionNode(t, srv.RESTConfig(), "node-a", gc, electionTimings{}, func(s *Store) { s.log = slog.New(logged) })
	endpointsHealth := func() (cell.Level, string) {
		for _, st := range n.health.All() {
			if strings.HasSuffix(st.Name, "job-identity-gc-endpoints") {
				return st.Level, st.Message
			}
		}
		return "", ""
	}
	if lvl, msg := endpointsHealth(); lvl != cell.StatusOK || !strings.Contains(msg, "Not collected yet") {
		t.Errorf("health before a run: %s %q", lvl, msg)
	}
	const id identity.NumericIdentity = 3001
	createIdentity(t, n.Store, id, mustLabels(t, "k8s:app=unnamed"), oldMark())
	if res := runGC(t, n.Store); res.Deleted != 1 {
		t.Fatalf("run without the CRDs: %+v, want one deleted", res)
	}
	if got := n.gc.endpoints.servedKinds(); got["CiliumEndpoint"] || got["CiliumEndpointSlice"] || len(got) != 2 {
		t.Errorf("served kinds %v, want neither", got)
	}
	lvl, msg := endpointsHealth()
	if lvl != cell.StatusOK || !strings.Contains(msg, "CiliumEndpoint and CiliumEndpointSlice CRDs not installed") {
		t.Errorf("health without the CRDs: %s %q", lvl, msg)
	}
	runGC(t, n.Store)
	for _, kind := range []string{"CiliumEndpoint", "CiliumEndpointSlice"} {
		if got := logged.count("does not serve " + kind + " objects"); got != 1 {
			t.Errorf("after two runs the log says %d times that %s objects are not served, want once", got, kind)
		}
	}
}

// infoLog records the messages of Info records.
type infoLog struct {
	mu   sync.Mutex
	msgs []string
}

func (l *infoLog) Enabled(context.Context, slog.Level) bool { return true }
func (l *infoLog) Handle(_ context.Context, r slog.Record) error {
	if r.Level == slog.LevelInfo {
		l.mu.Lock()
		l.msgs = append(l.msgs, r.Message)
		l.mu.Unlock()
	}
	return nil
}
func (l *infoLog) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *infoLog) WithGroup(string) slog.Handler      { return l }

func (l *infoLog) count(part string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, m := range l.msgs {
		if strings.Contains(m, part) {
			n++
		}
	}
	return n
}

// TestHeartbeatTimeoutBesideCilium: the cell refuses a heartbeat timeout
// shorter than MinHeartbeatTimeoutBesideCilium, naming the flag and the
// minimum, unless --identity-gc-cilium-agents=false, which allows down to
// MinHeartbeatTimeout.
func TestHeartbeatTimeoutBesideCilium(t *testing.T) {
	t.Parallel()
	rc := &rest.Config{Host: "https://127.0.0.1:1"}
	populate := func(agents bool, timeout time.Duration) error {
		stores := globalstore.DefaultConfig
		stores.IdentityHeartbeatTimeout = timeout
		h := hive.New(
			job.Cell,
			cell.Provide(
				func() *rest.Config { return rc },
				func() identity.ClusterInfo { return gcCluster },
				func() identity.NodeName { return "node-a" },
				func() globalstore.Config { return stores },
			),
			Cell,
			cell.Invoke(func(*Store) {}),
		)
		hive.AddConfigOverride(h, func(c *Config) { c.IdentityGCCiliumAgents = agents })
		return h.Populate(hivetest.Logger(t, hivetest.LogLevel(slog.LevelError)))
	}
	for _, tc := range []struct {
		agents  bool
		timeout time.Duration
		want    string // part of the error; empty: accepted
	}{
		{true, 2 * time.Minute, "--identity-heartbeat-timeout must be at least 10m0s beside Cilium agents, not 2m0s"},
		{true, MinHeartbeatTimeoutBesideCilium - time.Second, "--identity-heartbeat-timeout must be at least 10m0s"},
		{true, MinHeartbeatTimeoutBesideCilium, ""},
		{true, globalstore.DefaultConfig.IdentityHeartbeatTimeout, ""},
		{false, MinHeartbeatTimeout, ""},
		{false, MinHeartbeatTimeout - time.Second, "--identity-heartbeat-timeout must be at least 2m0s in crd mode"},
	} {
		err := populate(tc.agents, tc.timeout)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("cilium agents %v, timeout %s: %v, want accepted", tc.agents, tc.timeout, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("cilium agents %v, timeout %s: %v, want an error with %q", tc.agents, tc.timeout, err, tc.want)
		case tc.want != "" && tc.agents && !strings.Contains(err.Error(), "--identity-gc-cilium-agents=false"):
			t.Errorf("the error does not name --identity-gc-cilium-agents: %v", err)
		}
	}
}
