package crdstore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/allocator/globalstore/storetest"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/idprobe"
	"github.com/identityd/identityd/labels"
)

// testNode is one identityd node's store, in a hive of its own.
type testNode struct {
	tb    testing.TB
	name  string
	h     *hive.Hive
	store *Store
	refs  *storetest.Refs
	ev    *storetest.Events
	once  sync.Once
}

type nodeOpts struct {
	cluster identity.ClusterInfo
	cfg     Config
	refs    *storetest.Refs
	log     *slog.Logger
	// cells are added to the node's hive (a health provider, say).
	cells []cell.Cell
	// startErr, when set, takes the error of the hive's start instead
	// of failing the test; the node is returned stopped on error.
	startErr *error
}

func startNode(tb testing.TB, rc *rest.Config, name string, opts ...func(*nodeOpts)) *testNode {
	tb.Helper()
	o := nodeOpts{cluster: identity.ClusterInfo{Name: "default"}, cfg: DefaultConfig, refs: storetest.NewRefs()}
	for _, f := range opts {
		f(&o)
	}
	n := &testNode{tb: tb, name: name, refs: o.refs, ev: storetest.NewEvents()}
	n.h = hive.New(append([]cell.Cell{
		job.Cell,
		cell.Provide(
			func() *rest.Config { return rc },
			func() identity.ClusterInfo { return o.cluster },
			func() identity.NodeName { return identity.NodeName(name) },
			globalstore.NewSinks,
		),
		Cell,
		cell.Invoke(func(s *Store, sinks *globalstore.Sinks) {
			n.store = s
			sinks.For(identity.AllocationModeCRD).Bind(n.ev, n.refs)
		}),
	}, o.cells...)...)
	hive.AddConfigOverride(n.h, func(c *Config) { *c = o.cfg })
	log := o.log
	if log == nil {
		log = testLogger(tb)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := n.h.Start(log, ctx); err != nil {
		if o.startErr == nil {
			tb.Fatalf("starting node %s: %v", name, err)
		}
		*o.startErr = err
		return n
	}
	if n.store == nil {
		tb.Fatalf("node %s has no CRD store", name)
	}
	select {
	case <-n.ev.Listed():
	case <-ctx.Done():
		tb.Fatalf("node %s: identities not listed", name)
	}
	tb.Cleanup(n.stop)
	return n
}

// newUnstartedStore returns a store on the API server of rc that never
// starts, for the tests of its cache and walks alone.
func newUnstartedStore(tb testing.TB, rc *rest.Config, cluster identity.ClusterInfo, node identity.NodeName) *Store {
	tb.Helper()
	s, err := newUnconnected(hivetest.Logger(tb), cluster, node, DefaultConfig, new(globalstore.Sink))
	if err != nil {
		tb.Fatal(err)
	}
	if err := s.connect(rc); err != nil {
		tb.Fatal(err)
	}
	return s
}

func testLogger(tb testing.TB) *slog.Logger {
	if _, ok := tb.(*testing.B); ok {
		return hivetest.Logger(tb, hivetest.LogLevel(slog.LevelWarn))
	}
	return hivetest.Logger(tb)
}

func (n *testNode) stop() {
	n.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := n.h.Stop(testLogger(n.tb), ctx); err != nil {
			n.tb.Errorf("stopping node %s: %v", n.name, err)
		}
	})
}

func (n *testNode) allocate(tb testing.TB, lbls labels.Labels) (identity.NumericIdentity, bool) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	id, created, err := n.store.Allocate(ctx, lbls, n.refs.Record)
	if err != nil {
		tb.Fatalf("node %s: allocating %s: %v", n.name, lbls, err)
	}
	return id, created
}

// allocateWeb allocates web(0) to web(count-1) and returns their IDs.
func (n *testNode) allocateWeb(tb testing.TB, count int) []identity.NumericIdentity {
	tb.Helper()
	ids := make([]identity.NumericIdentity, count)
	for i := range count {
		ids[i], _ = n.allocate(tb, web(i))
	}
	return ids
}

func (n *testNode) release(tb testing.TB, id identity.NumericIdentity) {
	tb.Helper()
	ref := n.refs.Remove(id)
	if ref == nil {
		tb.Fatalf("node %s holds no %d", n.name, id)
	}
	if err := n.store.Release(context.Background(), ref); err != nil {
		tb.Fatalf("node %s: releasing %d: %v", n.name, id, err)
	}
}

// client talks to the API server directly, as another writer would.
type client struct {
	cilium, nodes *rest.RESTClient
}

func newClient(tb testing.TB, rc *rest.Config) *client {
	tb.Helper()
	codecs := newCodecs()
	c, err := restClient(rc, schema.GroupVersion{Group: CiliumGroup, Version: CiliumVersion}, codecs)
	if err != nil {
		tb.Fatal(err)
	}
	n, err := restClient(rc, schema.GroupVersion{Group: IdentityGroup, Version: IdentityVersion}, codecs)
	if err != nil {
		tb.Fatal(err)
	}
	return &client{cilium: c, nodes: n}
}

func (c *client) identities(tb testing.TB) []CiliumIdentity {
	tb.Helper()
	var list CiliumIdentityList
	if err := c.cilium.Get().Resource("ciliumidentities").Do(context.Background()).Into(&list); err != nil {
		tb.Fatalf("listing identities: %v", err)
	}
	return list.Items
}

func (c *client) identity(tb testing.TB, id identity.NumericIdentity) (*CiliumIdentity, error) {
	tb.Helper()
	var obj CiliumIdentity
	err := c.cilium.Get().Resource("ciliumidentities").Name(id.String()).Do(context.Background()).Into(&obj)
	return &obj, err
}

// holds returns nil when the CiliumIdentity of id holds lbls.
func (c *client) holds(tb testing.TB, id identity.NumericIdentity, lbls labels.Labels) error {
	obj, err := c.identity(tb, id)
	if err != nil {
		return err
	}
	if got, err := parseSecurityLabels(obj.SecurityLabels); err != nil || !got.Equal(lbls) {
		return fmt.Errorf("%d holds %v, want %s", id, obj.SecurityLabels, lbls.Canonical())
	}
	return nil
}

func (c *client) node(tb testing.TB, name string) (*IdentityNode, error) {
	tb.Helper()
	var obj IdentityNode
	err := c.nodes.Get().Resource("identitynodes").Name(name).Do(context.Background()).Into(&obj)
	return &obj, err
}

func (c *client) create(tb testing.TB, obj *CiliumIdentity) {
	tb.Helper()
	if err := c.cilium.Post().Resource("ciliumidentities").Body(obj).Do(context.Background()).Error(); err != nil {
		tb.Fatalf("creating %s: %v", obj.Name, err)
	}
}

func (c *client) mark(tb testing.TB, id identity.NumericIdentity) {
	tb.Helper()
	patch := fmt.Appendf(nil, `{"metadata":{"annotations":{%q:%q}}}`, HeartbeatAnnotation, time.Now().UTC().Format(time.RFC3339Nano))
	if err := c.cilium.Patch(types.MergePatchType).Resource("ciliumidentities").Name(id.String()).Body(patch).Do(context.Background()).Error(); err != nil {
		tb.Fatalf("marking %d: %v", id, err)
	}
}

func (c *client) marked(tb testing.TB, id identity.NumericIdentity) bool {
	obj, err := c.identity(tb, id)
	if err != nil {
		tb.Fatalf("reading %d: %v", id, err)
	}
	_, ok := obj.Annotations[HeartbeatAnnotation]
	return ok
}

// nodeLists waits until the IdentityNode of name lists exactly want.
func (c *client) nodeLists(t *testing.T, name string, want ...identity.NumericIdentity) {
	t.Helper()
	ids := make([]uint32, len(want))
	for i, id := range want {
		ids[i] = uint32(id)
	}
	slices.Sort(ids)
	require(t, 30*time.Second, func() error {
		n, err := c.node(t, name)
		if err != nil {
			return err
		}
		if !slices.Equal(n.Spec.Identities, ids) {
			return fmt.Errorf("IdentityNode %s lists %v, want %v", name, n.Spec.Identities, ids)
		}
		return nil
	})
}

// require polls fn until it returns nil, and fails with its last error
// after d. The condition is a request or a cache's state, so it is polled
// at a pace the API server does not notice.
func require(tb testing.TB, d time.Duration, fn func() error) {
	tb.Helper()
	deadline := time.Now().Add(d)
	for {
		err := fn()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			tb.Fatalf("after %v: %v", d, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func web(i int) labels.Labels {
	return labels.MustParse(fmt.Sprintf("k8s:app=web-%d", i), "k8s:io.kubernetes.pod.namespace=prod")
}

func TestAllocateAdoptRelease(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	cli := newClient(t, srv.RESTConfig())
	a := startNode(t, srv.RESTConfig(), "node-a")
	b := startNode(t, srv.RESTConfig(), "node-b")

	lbls := web(1)
	id, created := a.allocate(t, lbls)
	if !created {
		t.Fatalf("node-a did not create %s", lbls)
	}
	if want := idprobe.New(lbls.Canonical(), a.store.cluster).Slot(0); id != want {
		t.Errorf("the first identity got %d, want the first slot of its sequence %d", id, want)
	}
	obj, err := cli.identity(t, id)
	if err != nil {
		t.Fatal(err)
	}
	if !maps.Equal(obj.SecurityLabels, map[string]string{"k8s:app": "web-1", "k8s:io.kubernetes.pod.namespace": "prod"}) ||
		!maps.Equal(obj.Labels, map[string]string{"app": "web-1", "io.kubernetes.pod.namespace": "prod"}) {
		t.Errorf("object %s: security-labels %v, labels %v", obj.Name, obj.SecurityLabels, obj.Labels)
	}
	got, created := b.allocate(t, lbls)
	if got != id || created {
		t.Errorf("node-b allocated %d (created %v), want %d adopted", got, created, id)
	}
	cli.nodeLists(t, "node-a", id)
	cli.nodeLists(t, "node-b", id)
	require(t, 10*time.Second, func() error {
		if l, ok := b.ev.Get(id); !ok || !l.Equal(lbls) {
			return fmt.Errorf("node-b's events do not have %d", id)
		}
		return nil
	})

	expectSamples(t, samples(t, a.store), map[string]float64{
		"identityd_crd_allocations_total{outcome=created}": 1,
		"identityd_crd_allocations_total{outcome=adopted}": 0,
		"identityd_crd_split_label_sets_total":             0,
	})
	expectSamples(t, samples(t, b.store), map[string]float64{
		"identityd_crd_allocations_total{outcome=adopted}": 1,
	})

	a.release(t, id)
	cli.nodeLists(t, "node-a")
	cli.nodeLists(t, "node-b", id)
	if _, err := cli.identity(t, id); err != nil {
		t.Errorf("the identity is gone after a release: %v", err)
	}
}

func TestRestartKeepsIdentities(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	cli := newClient(t, srv.RESTConfig())
	a := startNode(t, srv.RESTConfig(), "node-a")
	ids := a.allocateWeb(t, 10)
	cli.nodeLists(t, "node-a", ids...)
	before, err := cli.node(t, "node-a")
	if err != nil {
		t.Fatal(err)
	}
	a.stop()

	// The restarted node's allocator restores its references; the
	// record is rewritten from them.
	refs := storetest.NewRefs()
	a2 := startNode(t, srv.RESTConfig(), "node-a", func(o *nodeOpts) { o.refs = refs })
	for i, want := range ids {
		id, created := a2.allocate(t, web(i))
		if id != want || created {
			t.Errorf("after the restart %s got %d (created %v), want %d", web(i), id, created, want)
		}
	}
	cli.nodeLists(t, "node-a", ids...)
	after, err := cli.node(t, "node-a")
	if err != nil {
		t.Fatal(err)
	}
	if !after.Spec.RenewTime.After(before.Spec.RenewTime.Time) {
		t.Errorf("IdentityNode not renewed by the restart: %v, then %v", before.Spec.RenewTime, after.Spec.RenewTime)
	}
}

func TestHostileLabelsAreStored(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	cli := newClient(t, srv.RESTConfig())
	a := startNode(t, srv.RESTConfig(), "node-a")
	b := startNode(t, srv.RESTConfig(), "node-b")
	for _, lbls := range hostileLabels(t) {
		id, _ := a.allocate(t, lbls)
		obj, err := cli.identity(t, id)
		if err != nil {
			t.Fatal(err)
		}
		back, err := parseSecurityLabels(obj.SecurityLabels)
		if err != nil || !back.Equal(lbls) {
			t.Errorf("%d holds %v, want %s", id, obj.SecurityLabels, lbls)
		}
		if got, _ := b.allocate(t, lbls); got != id {
			t.Errorf("node-b got %d for %s, node-a %d", got, lbls, id)
		}
	}
}

func TestMalformedObjectsAreIgnored(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	cli := newClient(t, srv.RESTConfig())
	a := startNode(t, srv.RESTConfig(), "node-a")
	lbls := web(1)
	p := idprobe.New(lbls.Canonical(), a.store.cluster)
	bad := []*CiliumIdentity{
		{ObjectMeta: metav1.ObjectMeta{Name: "web"}, SecurityLabels: securityLabels(lbls)},
		{ObjectMeta: metav1.ObjectMeta{Name: "70000"}, SecurityLabels: securityLabels(lbls)},
		// The first slot of lbls, with labels that do not parse: it
		// holds the ID all the same.
		{ObjectMeta: metav1.ObjectMeta{Name: p.Slot(0).String()}, SecurityLabels: map[string]string{"nosource": "x"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "0300"}, SecurityLabels: securityLabels(web(2))},
	}
	for _, o := range bad {
		cli.create(t, o)
	}
	require(t, 10*time.Second, func() error {
		if got := a.store.ids.ignoredTotal.Load(); got != uint64(len(bad)) {
			return fmt.Errorf("%d objects ignored, want %d", got, len(bad))
		}
		return nil
	})
	id, created := a.allocate(t, lbls)
	if !created || id != p.Slot(1) {
		t.Errorf("got %d (created %v), want %d, the slot after the unparsable object", id, created, p.Slot(1))
	}
	expectSamples(t, samples(t, a.store), map[string]float64{
		"identityd_crd_ignored_objects_total": float64(len(bad)),
	})
	// A node started after them ignores them too.
	b := startNode(t, srv.RESTConfig(), "node-b")
	if got := b.store.ids.ignoredTotal.Load(); got != uint64(len(bad)) {
		t.Errorf("node-b ignored %d objects, want %d", got, len(bad))
	}
	if got, _ := b.allocate(t, lbls); got != id {
		t.Errorf("node-b got %d, want %d", got, id)
	}
}

// TestHeartbeatMarks checks Cilium's protocol: a node removes the mark from
// an identity it uses and from one it adopts; one whose slot its new
// identity skips keeps its mark and gets the step annotation.
func TestHeartbeatMarks(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	cli := newClient(t, srv.RESTConfig())
	a := startNode(t, srv.RESTConfig(), "node-a")
	b := startNode(t, srv.RESTConfig(), "node-b")

	held, _ := a.allocate(t, web(1))
	cli.mark(t, held)
	require(t, 10*time.Second, func() error {
		if cli.marked(t, held) {
			return errors.New("the mark of an identity in use is still there")
		}
		return nil
	})

	adopted, _ := a.allocate(t, web(2))
	a.release(t, adopted)
	cli.mark(t, adopted)
	require(t, 10*time.Second, func() error {
		if e := b.store.ids.get(adopted); e == nil || !e.marked() {
			return errors.New("node-b has not seen the mark")
		}
		return nil
	})
	if got, _ := b.allocate(t, web(2)); got != adopted {
		t.Fatalf("node-b got %d, want %d", got, adopted)
	}
	if cli.marked(t, adopted) {
		t.Error("adopting a marked identity left the mark")
	}

	// Another label set at the first slot of web(3), marked long enough
	// ago that a collector could delete it before the walk's object is in
	// its cache (a younger mark needs no announcement:
	// TestWalkAnnouncesOldMarksOnly).
	lbls := web(3)
	p := idprobe.New(lbls.Canonical(), a.store.cluster)
	skipped := p.Slot(0)
	cli.create(t, &CiliumIdentity{ObjectMeta: metav1.ObjectMeta{Name: skipped.String(),
		Annotations: map[string]string{HeartbeatAnnotation: time.Now().Add(-10 * time.Minute).UTC().Format(time.RFC3339)}},
		SecurityLabels: securityLabels(web(1000))})
	require(t, 10*time.Second, func() error {
		if a.store.ids.get(skipped) == nil {
			return errors.New("node-a has not seen the object")
		}
		return nil
	})
	if id, _ := a.allocate(t, lbls); id != p.Slot(1) {
		t.Errorf("got %d, want %d", id, p.Slot(1))
	}
	// The slot keeps its mark, so that its timeout goes on, and carries
	// the announcement of the step, which defers the collector's delete.
	// Without the change the skip removed the mark (checked).
	if !cli.marked(t, skipped) {
		t.Error("stepping over a marked slot removed its mark")
	}
	obj, err := cli.identity(t, skipped)
	if err != nil {
		t.Fatal(err)
	}
	if at, err := time.Parse(time.RFC3339Nano, obj.Annotations[stepAnnotation]); err != nil || time.Since(at) > time.Minute {
		t.Errorf("the stepped-over slot's annotation %q: %v, want the time of the walk", obj.Annotations[stepAnnotation], err)
	}
}

// TestDeletedIdentityInUseIsRecreated: an object deleted by someone who
// does not follow the collector's rules comes back while a node uses it.
func TestDeletedIdentityInUseIsRecreated(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	cli := newClient(t, srv.RESTConfig())
	a := startNode(t, srv.RESTConfig(), "node-a")
	id, _ := a.allocate(t, web(1))
	if err := cli.cilium.Delete().Resource("ciliumidentities").Name(id.String()).Do(context.Background()).Error(); err != nil {
		t.Fatal(err)
	}
	require(t, 20*time.Second, func() error { return cli.holds(t, id, web(1)) })
}

// TestTakenIdentityReported: the object of an identity node-a uses comes
// to hold another label set, as when the ID was freed while node-a's record
// was gone and another node created it for its own label set. Other nodes
// now apply that label set's policy to node-a's users of the ID: node-a
// cannot take the ID back, but it reports it (health degraded, counted once)
// for as long as it lasts: until it re-creates its own object once the
// other label set's is deleted, or until it releases the ID.
func TestTakenIdentityReported(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	cli := newClient(t, srv.RESTConfig())
	var healthA *cell.SimpleHealth
	a := startNode(t, srv.RESTConfig(), "node-a", func(o *nodeOpts) {
		o.cells = []cell.Cell{cell.SimpleHealthCell, cell.Invoke(func(h *cell.SimpleHealth) { healthA = h })}
	})
	id, _ := a.allocate(t, web(1))
	obj, err := cli.identity(t, id)
	if err != nil {
		t.Fatal(err)
	}
	obj.SecurityLabels = securityLabels(web(999))
	if err := cli.cilium.Put().Resource("ciliumidentities").Name(id.String()).Body(obj).Do(context.Background()).Error(); err != nil {
		t.Fatal(err)
	}
	unmark := func() (cell.Level, string) {
		scope := healthA.GetChild("job-identity-unmark")
		if scope == nil {
			return "", "no health scope job-identity-unmark"
		}
		scope.Lock()
		defer scope.Unlock()
		return scope.Level, scope.Status + " " + fmt.Sprint(scope.Error)
	}
	taken := func() error {
		if level, status := unmark(); level != cell.StatusDegraded || !strings.Contains(status, web(999).Canonical()) {
			return fmt.Errorf("identity-unmark health %s %q while %d holds another label set", level, status, id)
		}
		if n := a.store.stats.taken.Load(); n != 1 {
			return fmt.Errorf("taken identities counted %d times, want 1", n)
		}
		return nil
	}
	require(t, 20*time.Second, taken)

	// Other rounds of the loop (a release wakes it) keep reporting it,
	// and count it once.
	other, _ := a.allocate(t, web(2))
	a.release(t, other)
	cli.nodeLists(t, "node-a", id)
	time.Sleep(200 * time.Millisecond)
	if err := taken(); err != nil {
		t.Fatal(err)
	}
	expectSamples(t, samples(t, a.store), map[string]float64{"identityd_crd_identities_taken_total": 1})

	// The other label set's object goes: node-a's comes back, and so does
	// its health.
	if err := cli.cilium.Delete().Resource("ciliumidentities").Name(id.String()).Do(context.Background()).Error(); err != nil {
		t.Fatal(err)
	}
	require(t, 20*time.Second, func() error {
		if err := cli.holds(t, id, web(1)); err != nil {
			return err
		}
		if level, status := unmark(); level != cell.StatusOK {
			return fmt.Errorf("identity-unmark health %s %q after the ID came back", level, status)
		}
		return nil
	})

	// Taken again, then released by node-a: the report ends with the
	// release.
	if obj, err = cli.identity(t, id); err != nil {
		t.Fatal(err)
	}
	obj.SecurityLabels = securityLabels(web(999))
	if err := cli.cilium.Put().Resource("ciliumidentities").Name(id.String()).Body(obj).Do(context.Background()).Error(); err != nil {
		t.Fatal(err)
	}
	require(t, 20*time.Second, func() error {
		if level, _ := unmark(); level != cell.StatusDegraded || a.store.stats.taken.Load() != 2 {
			return fmt.Errorf("identity-unmark health %s, %d taken, after %d was taken again", level, a.store.stats.taken.Load(), id)
		}
		return nil
	})
	a.release(t, id)
	require(t, 20*time.Second, func() error {
		if level, status := unmark(); level != cell.StatusOK {
			return fmt.Errorf("identity-unmark health %s %q after node-a released the taken ID", level, status)
		}
		return nil
	})
}

func TestSpaceExhausted(t *testing.T) {
	cluster := identity.ClusterInfo{ID: 3, Name: "c3", MaxConnectedClusters: 511}
	s := newUnstartedStore(t, &rest.Config{Host: "https://127.0.0.1:1"}, cluster, "node-a")
	var list []any
	for id := cluster.MinID(); id <= cluster.MaxID(); id++ {
		list = append(list, object(id, labels.MustParse(fmt.Sprintf("k8s:n=%d", id)), time.Now()))
	}
	s.events = storetest.NewEvents()
	if err := s.ids.Replace(list, "1"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, _, err := s.Allocate(ctx, web(1), func(*globalstore.Reference) { t.Error("record called on failure") })
	if !errors.Is(err, globalstore.ErrSpaceExhausted) {
		t.Errorf("Allocate in a full range: %v, want ErrSpaceExhausted", err)
	}
}

// countingTransport counts the requests sent through it.
type countingTransport struct {
	next http.RoundTripper
	n    *atomic.Int64
}

func (c countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	c.n.Add(1)
	return c.next.RoundTrip(r)
}

// counted returns a copy of rc whose requests count in n.
func counted(rc *rest.Config, n *atomic.Int64) *rest.Config {
	rc = rest.CopyConfig(rc)
	rc.Wrap(func(rt http.RoundTripper) http.RoundTripper { return countingTransport{next: rt, n: n} })
	return rc
}

// TestCreateCostsOneRequest checks the design's figure: a new label set
// whose first slot is free costs one request, one in the cache none.
func TestCreateCostsOneRequest(t *testing.T) {
	srv := serialServer(t)
	var n atomic.Int64
	a := startNode(t, counted(srv.RESTConfig(), &n), "node-a")
	// Let the start's writes settle.
	cliA := newClient(t, srv.RESTConfig())
	cliA.nodeLists(t, "node-a")
	time.Sleep(100 * time.Millisecond)
	// The record's coalesced writes are not the allocation's: count
	// them apart.
	writes0, n0 := a.store.writer.writes.Load(), n.Load()
	const count = 20
	for i := range count {
		a.allocate(t, web(i))
	}
	for i := range count {
		a.allocate(t, web(i)) // the allocator would not ask again; the store must not send anything
	}
	requests := n.Load() - n0 - int64(a.store.writer.writes.Load()-writes0)
	if requests > count+1 {
		t.Errorf("%d requests for %d new label sets and %d known ones, want %d", requests, count, count, count)
	}
	_ = apierrors.IsNotFound
}

// TestAdoptFromStaleCache: the cache shows a marked object of the label
// set at an older resourceVersion than the server's; the adoption's
// unmark conflicts, and must read the object rather than send the stale
// version again until the conflicts run out. (The store is not started,
// so its cache stays as the test sets it.)
func TestAdoptFromStaleCache(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	cli := newClient(t, srv.RESTConfig())
	cluster := identity.ClusterInfo{Name: "default"}
	lbls := web(1)
	id := idprobe.New(lbls.Canonical(), cluster).Slot(0)
	cli.create(t, &CiliumIdentity{ObjectMeta: metav1.ObjectMeta{Name: id.String()}, SecurityLabels: securityLabels(lbls)})
	cli.mark(t, id)
	stale, err := cli.identity(t, id)
	if err != nil {
		t.Fatal(err)
	}
	cli.mark(t, id) // a newer version
	s := newUnstartedStore(t, srv.RESTConfig(), cluster, "node-a")
	s.events = storetest.NewEvents()
	if err := s.ids.Replace([]any{stale}, stale.ResourceVersion); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	refs := storetest.NewRefs()
	got, created, err := s.Allocate(ctx, lbls, refs.Record)
	if err != nil || got != id || created {
		t.Fatalf("Allocate = %d, %v, %v; want %d adopted", got, created, err, id)
	}
	if cli.marked(t, id) {
		t.Error("the adopted identity is still marked")
	}
}

// TestAllocateServerDown: with the API server gone, a new label set fails
// within its context with ErrUnavailable, in words that name the store in
// general rather than etcd.
func TestAllocateServerDown(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	a := startNode(t, srv.RESTConfig(), "node-a")
	srv.Stop(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	_, _, err := a.store.Allocate(ctx, web(1), a.refs.Record)
	if !errors.Is(err, globalstore.ErrUnavailable) {
		t.Fatalf("allocate with the API server stopped: %v, want ErrUnavailable", err)
	}
	if msg := err.Error(); !strings.Contains(msg, "global identity store unavailable") || strings.Contains(msg, "kvstore") {
		t.Errorf("error %q should say the global identity store is unavailable, and not name the kvstore", msg)
	}
}
