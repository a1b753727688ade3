package workloads

import (
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/cells/k8sclient"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/eventually"
	"github.com/identityd/identityd/internal/ipcachemap"
	"github.com/identityd/identityd/internal/testhive"
)

const testGrace = 5 * time.Second

// node is a Workloads on a real allocator (global identities in the
// embedded etcd) and a real ipcache, fed pods and namespaces through
// client-go stores as the informers feed it, on a clock of the test's.
type node struct {
	t     *testing.T
	w     *Workloads
	alloc allocator.Allocator
	ipc   *ipcache.IPCache
	now   time.Time
}

func newNode(t *testing.T) *node {
	t.Helper()
	return newNodeWith(t, kvstore.Cell, etcdstore.Cell)
}

// newNodeWith is newNode with the given store cells (none: global
// allocations fail, for want of a store).
func newNodeWith(t *testing.T, stores ...cell.Cell) *node {
	t.Helper()
	n := &node{t: t, now: time.Unix(1_000_000, 0)}
	h := hive.New(append([]cell.Cell{
		cell.SimpleHealthCell, job.Cell, statedb.Cell, statedir.Cell,
		allocator.Cell, ipcache.Cell,
		cell.Invoke(func(a allocator.Allocator, c *ipcache.IPCache) { n.alloc, n.ipc = a, c }),
	}, stores...)...)
	dir := t.TempDir()
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(h, func(c *ipcache.Config) { c.IPCacheMap = string(ipcachemap.KindFile) })
	testhive.Start(t, h)
	f, err := NewLabelFilter(nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	n.w = newWorkloads(hivetest.Logger(t), Config{IdentityChangeGracePeriod: testGrace}, f, "n1", "c1", n.alloc, n.ipc, newWorkloadMetrics())
	n.w.now = func() time.Time { return n.now }
	n.w.src = sources{
		pods:       cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc}),
		namespaces: cache.NewStore(cache.MetaNamespaceKeyFunc),
	}
	return n
}

// setPod stores pod as the informer would and runs a pass.
func (n *node) setPod(p *corev1.Pod) {
	n.t.Helper()
	if err := n.w.src.pods.Update(p); err != nil {
		n.t.Fatal(err)
	}
	n.w.markDirty(p.Namespace + "/" + p.Name)
	n.w.pass(n.t.Context())
}

func (n *node) deletePod(p *corev1.Pod) {
	n.t.Helper()
	if err := n.w.src.pods.Delete(p); err != nil {
		n.t.Fatal(err)
	}
	n.w.markDirty(p.Namespace + "/" + p.Name)
	n.w.pass(n.t.Context())
}

func (n *node) setNamespace(ns *corev1.Namespace) {
	n.t.Helper()
	if err := n.w.src.namespaces.Update(ns); err != nil {
		n.t.Fatal(err)
	}
	n.w.markNamespace(ns.Name)
	n.w.pass(n.t.Context())
}

// advance moves the clock and runs a pass.
func (n *node) advance(d time.Duration) {
	n.now = n.now.Add(d)
	n.w.pass(n.t.Context())
}

// identity returns the identity pod holds (0: none).
func (n *node) identity(key string) identity.NumericIdentity {
	for _, p := range n.w.List() {
		if p.Name == key {
			return p.Identity
		}
	}
	return 0
}

// refs is the node's reference count on id.
func (n *node) refs(id identity.NumericIdentity) int {
	for _, e := range n.alloc.List() {
		if e.Identity.ID == id {
			return e.RefCount
		}
	}
	return 0
}

// expectRows checks the ipcache rows of the pod's owner: exactly prefixes,
// each with id.
func (n *node) expectRows(key string, id identity.NumericIdentity, prefixes ...string) {
	n.t.Helper()
	var got []string
	for _, e := range n.ipc.ListOwner(owner(key)) {
		got = append(got, e.Prefix.String())
		if e.Identity != id {
			n.t.Errorf("%s: %s has identity %d, want %d", key, e.Prefix, e.Identity, id)
		}
	}
	slices.Sort(got)
	if !slices.Equal(got, prefixes) {
		n.t.Errorf("%s: ipcache rows %q, want %q", key, got, prefixes)
	}
}

func TestPodIdentityAndIPs(t *testing.T) {
	n := newNode(t)
	n.setNamespace(testNamespace("ns", nil))
	a := testPod("a", map[string]string{"app": "web"}, "10.0.0.1", "fd00::1")
	b := testPod("b", map[string]string{"app": "web", "pod-template-hash": "x"}, "10.0.0.2")
	n.setPod(a)
	n.setPod(b)
	id := n.identity("ns/a")
	if id == 0 || id.HasLocalScope() {
		t.Fatalf("pod a: identity %d, want a global one", id)
	}
	if got := n.identity("ns/b"); got != id {
		t.Fatalf("pod b with the same identity labels: identity %d, want %d", got, id)
	}
	if r := n.refs(id); r != 2 {
		t.Fatalf("references on %d: %d, want one per pod", id, r)
	}
	n.expectRows("ns/a", id, "10.0.0.1/32", "fd00::1/128")
	n.expectRows("ns/b", id, "10.0.0.2/32")
	if g := testutil.ToFloat64(n.w.metrics.withoutIdentity); g != 0 {
		t.Errorf("pods without identity: %g", g)
	}
	if c := testutil.CollectAndCount(n.w.metrics.wait); c != 1 {
		t.Errorf("wait histogram: %d series", c)
	}

	// A new IP: the row moves, the identity stays.
	a2 := a.DeepCopy()
	a2.Status.PodIPs = []corev1.PodIP{{IP: "10.0.0.9"}, {IP: "fd00::1"}}
	n.setPod(a2)
	n.expectRows("ns/a", id, "10.0.0.9/32", "fd00::1/128")
	if r := n.refs(id); r != 2 {
		t.Fatalf("after an IP change: references on %d: %d, want 2", id, r)
	}
}

// TestRelabelGrace: a pod's new labels give it a new identity at once, in
// the ipcache too; the old one is held for the grace period, then
// released.
func TestRelabelGrace(t *testing.T) {
	n := newNode(t)
	n.setNamespace(testNamespace("ns", nil))
	p := testPod("p", map[string]string{"app": "v1"}, "10.0.0.1")
	n.setPod(p)
	old := n.identity("ns/p")

	p2 := p.DeepCopy()
	p2.Labels = map[string]string{"app": "v2"}
	n.setPod(p2)
	cur := n.identity("ns/p")
	if cur == 0 || cur == old {
		t.Fatalf("relabelled pod: identity %d, old %d", cur, old)
	}
	n.expectRows("ns/p", cur, "10.0.0.1/32")
	if r := n.refs(old); r != 1 {
		t.Fatalf("old identity right after the relabel: %d references, want 1 (the grace period's)", r)
	}
	n.advance(testGrace - time.Second)
	if r := n.refs(old); r != 1 {
		t.Fatalf("old identity before the grace period ended: %d references, want 1", r)
	}
	n.advance(time.Second)
	if r := n.refs(old); r != 0 {
		t.Fatalf("old identity after the grace period: %d references, want 0", r)
	}
	if r := n.refs(cur); r != 1 {
		t.Fatalf("new identity: %d references, want 1", r)
	}
}

// TestNamespaceRelabel: a namespace's new labels move each of its pods to
// a new identity; the old one goes after the grace period.
func TestNamespaceRelabel(t *testing.T) {
	n := newNode(t)
	n.setNamespace(testNamespace("ns", map[string]string{"team": "a"}))
	n.setNamespace(testNamespace("other", map[string]string{"team": "a"}))
	p := testPod("p", map[string]string{"app": "web"}, "10.0.0.1")
	q := testPod("q", map[string]string{"app": "web"}, "10.0.0.2")
	o := testPod("o", map[string]string{"app": "web"}, "10.0.0.3")
	o.Namespace = "other"
	n.setPod(p)
	n.setPod(q)
	n.setPod(o)
	old, otherID := n.identity("ns/p"), n.identity("other/o")

	n.setNamespace(testNamespace("ns", map[string]string{"team": "b"}))
	cur := n.identity("ns/p")
	if cur == old || cur == 0 || n.identity("ns/q") != cur {
		t.Fatalf("after the namespace relabel: p %d, q %d, old %d", cur, n.identity("ns/q"), old)
	}
	if n.identity("other/o") != otherID {
		t.Fatalf("a pod of another namespace changed identity: %d, was %d", n.identity("other/o"), otherID)
	}
	n.expectRows("ns/q", cur, "10.0.0.2/32")
	if r := n.refs(old); r != 2 {
		t.Fatalf("old identity during the grace period: %d references, want 2", r)
	}
	n.advance(testGrace)
	if r := n.refs(old); r != 0 {
		t.Fatalf("old identity after the grace period: %d references, want 0", r)
	}
}

// TestHostNetworkTerminalDeleted: a host-network pod holds nothing; a pod
// that ends or is deleted leaves the ipcache at once and releases its
// identity after the grace period.
func TestHostNetworkTerminalDeleted(t *testing.T) {
	n := newNode(t)
	n.setNamespace(testNamespace("ns", nil))
	h := testPod("h", map[string]string{"app": "host"}, "192.168.0.10")
	h.Spec.HostNetwork = true
	n.setPod(h)
	if id := n.identity("ns/h"); id != 0 {
		t.Fatalf("host-network pod: identity %d", id)
	}
	n.expectRows("ns/h", 0)

	done := testPod("done", map[string]string{"app": "job"}, "10.0.0.5")
	gone := testPod("gone", map[string]string{"app": "gone"}, "10.0.0.6")
	n.setPod(done)
	n.setPod(gone)
	doneID, goneID := n.identity("ns/done"), n.identity("ns/gone")

	finished := done.DeepCopy()
	finished.Status.Phase = corev1.PodSucceeded
	n.setPod(finished)
	n.deletePod(gone)
	n.expectRows("ns/done", 0)
	n.expectRows("ns/gone", 0)
	if _, ok := n.ipc.LookupPrefix(netip.MustParsePrefix("10.0.0.6/32")); ok {
		t.Fatal("deleted pod's IP still in the ipcache")
	}
	if n.refs(doneID) != 1 || n.refs(goneID) != 1 {
		t.Fatalf("during the grace period: references %d, %d; want 1, 1", n.refs(doneID), n.refs(goneID))
	}
	n.advance(testGrace)
	if n.refs(doneID) != 0 || n.refs(goneID) != 0 {
		t.Fatalf("after the grace period: references %d, %d; want 0, 0", n.refs(doneID), n.refs(goneID))
	}
	for _, p := range n.w.List() {
		if p.Name == "ns/gone" {
			t.Fatalf("deleted pod still listed: %+v", p)
		}
	}
}

// TestWaitsForNamespace: a pod whose namespace is not known yet waits,
// counted as without identity, and gets it once the namespace comes.
func TestWaitsForNamespace(t *testing.T) {
	n := newNode(t)
	p := testPod("p", map[string]string{"app": "web"}, "10.0.0.1")
	n.setPod(p)
	if id := n.identity("ns/p"); id != 0 {
		t.Fatalf("identity %d before the namespace is known", id)
	}
	if g := testutil.ToFloat64(n.w.metrics.withoutIdentity); g != 1 {
		t.Fatalf("pods without identity: %g, want 1", g)
	}
	n.now = n.now.Add(3 * time.Second)
	n.setNamespace(testNamespace("ns", nil))
	if id := n.identity("ns/p"); id == 0 {
		t.Fatal("no identity once the namespace is known")
	}
	if g := testutil.ToFloat64(n.w.metrics.withoutIdentity); g != 0 {
		t.Fatalf("pods without identity: %g, want 0", g)
	}
	var m dto.Metric
	if err := n.w.metrics.wait.Write(&m); err != nil {
		t.Fatal(err)
	}
	if c, s := m.GetHistogram().GetSampleCount(), m.GetHistogram().GetSampleSum(); c != 1 || s != 3 {
		t.Fatalf("wait: %d samples, sum %gs; want 1 of 3s", c, s)
	}
}

// TestAllocationFailureRetried: a pod whose identity cannot be allocated
// (here: no store of global identities) is counted, listed with its
// failures and retried after a backoff, not at every pass.
func TestAllocationFailureRetried(t *testing.T) {
	n := newNodeWith(t)
	n.setNamespace(testNamespace("ns", nil))
	n.setPod(testPod("p", map[string]string{"app": "web"}, "10.0.0.1"))
	if got := testutil.ToFloat64(n.w.metrics.failures); got != 1 {
		t.Fatalf("failures after the first attempt: %g, want 1", got)
	}
	if g := testutil.ToFloat64(n.w.metrics.withoutIdentity); g != 1 {
		t.Fatalf("pods without identity: %g, want 1", g)
	}
	rows := n.w.List()
	if len(rows) != 1 || rows[0].State != "allocation failed 1 times" || rows[0].Identity != 0 {
		t.Fatalf("workloads list: %+v", rows)
	}
	n.expectRows("ns/p", 0)
	// An unrelated event passes before the retry is due: no attempt.
	n.setNamespace(testNamespace("other", nil))
	n.advance(100 * time.Millisecond)
	if got := testutil.ToFloat64(n.w.metrics.failures); got != 1 {
		t.Fatalf("failures before the backoff ended: %g, want 1", got)
	}
	// The first backoff is at most a second.
	n.advance(time.Second)
	if got := testutil.ToFloat64(n.w.metrics.failures); got != 2 {
		t.Fatalf("failures after the backoff: %g, want 2", got)
	}
	if next := n.w.finishPass(n.now); !next.After(n.now) || next.Sub(n.now) > 2*time.Second {
		t.Fatalf("next retry at %s from now, want within the second backoff (at most 2s)", next.Sub(n.now))
	}
}

// TestMapPruneHeldUntilPodsServed: the ipcache prunes nothing of the
// datapath map (its table is not initialized) while a pod of the first
// listing has no identity yet, at most until the bound; once every pod
// holds its identity it may.
func TestMapPruneHeldUntilPodsServed(t *testing.T) {
	for _, tc := range []struct {
		name   string
		stores []cell.Cell
	}{
		{"pods served", []cell.Cell{kvstore.Cell, etcdstore.Cell}},
		{"allocations failing", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := newNodeWith(t, tc.stores...)
			n.w.initDone = n.ipc.RegisterInitializer("workloads")
			n.w.initDeadline = n.now.Add(initialHoldBound)
			initialized := func() bool { ok, _ := n.ipc.Initialized(); return ok }
			if initialized() {
				t.Fatal("ipcache initialized before the first listing was served")
			}
			// A pod waits for its namespace: the hold stays.
			n.setPod(testPod("p", map[string]string{"app": "web"}, "10.0.0.1"))
			if initialized() {
				t.Fatal("ipcache initialized while a pod waits for its namespace")
			}
			n.setNamespace(testNamespace("ns", nil))
			// The ipcache's own initializer is done by a job of its
			// own, which may not have run yet.
			if tc.stores != nil {
				eventually.Within(t, 10*time.Second, "ipcache initialized once every pod holds its identity", initialized)
				return
			}
			if initialized() {
				t.Fatal("ipcache initialized while the pod's allocation fails")
			}
			n.advance(initialHoldBound)
			eventually.Within(t, 10*time.Second, "ipcache initialized after the bound of "+initialHoldBound.String(), initialized)
		})
	}
}

// TestOffWithoutKubernetes: without a Kubernetes client (kvstore mode, no
// kubeconfig) the cell provides no Workloads, starts nothing, and says so
// once in the log.
func TestOffWithoutKubernetes(t *testing.T) {
	var (
		w   *Workloads
		out syncBuffer
	)
	h := hive.New(
		cell.SimpleHealthCell, job.Cell, statedb.Cell, statedir.Cell,
		allocator.Cell, ipcache.Cell, k8sclient.Cell, Cell,
		cell.Invoke(func(got *Workloads) { w = got }),
	)
	dir := t.TempDir()
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(h, func(c *ipcache.Config) { c.IPCacheMap = string(ipcachemap.KindFile) })
	if _, err := testhive.TryStart(t, h, slog.New(slog.NewTextHandler(&out, nil))); err != nil {
		t.Fatal(err)
	}
	if w != nil {
		t.Fatal("a Workloads without a Kubernetes client")
	}
	if n := strings.Count(out.String(), "pods get no identities from this node"); n != 1 {
		t.Fatalf("the cell said it is off %d times, want once:\n%s", n, out.String())
	}
}

// syncBuffer is a strings.Builder safe for the hive's concurrent logging.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
