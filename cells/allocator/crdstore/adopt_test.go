package crdstore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	clientv3 "go.etcd.io/etcd/client/v3"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/uuid"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/idprobe"
	"github.com/identityd/identityd/internal/k8stest"
	"github.com/identityd/identityd/labels"
)

// ciliumWriter creates CiliumIdentity objects as Cilium v1.16.2's agents
// do: at a random free ID of the range, named by the ID, with the
// security-labels and the object labels Cilium's SanitizeK8sLabels
// selects.
type ciliumWriter struct {
	tb      testing.TB
	cli     *client
	cluster identity.ClusterInfo
	rng     *rand.Rand
	used    map[identity.NumericIdentity]bool
}

func newCiliumWriter(tb testing.TB, cli *client, cluster identity.ClusterInfo) *ciliumWriter {
	return &ciliumWriter{tb: tb, cli: cli, cluster: cluster, rng: rand.New(rand.NewPCG(33, 2)), used: map[identity.NumericIdentity]bool{}}
}

func (w *ciliumWriter) create(lbls labels.Labels) identity.NumericIdentity {
	w.tb.Helper()
	lo, hi := uint64(w.cluster.MinID()), uint64(w.cluster.MaxID())
	for {
		id := identity.NumericIdentity(lo + w.rng.Uint64N(hi-lo+1))
		if w.used[id] {
			continue
		}
		w.used[id] = true
		objLabels, _ := objectLabels(lbls)
		w.cli.create(w.tb, &CiliumIdentity{ObjectMeta: metav1.ObjectMeta{Name: id.String(), Labels: objLabels}, SecurityLabels: securityLabels(lbls)})
		return id
	}
}

// holdWatch holds the CiliumIdentity watch of n: the node's cache stays as
// it is (a consistent prefix of the server's history, behind) until the
// returned release.
func holdWatch(t *testing.T, n *testNode) (release func()) {
	ch := make(chan struct{})
	n.store.ids.gate.Store(&ch)
	var once sync.Once
	release = func() {
		once.Do(func() {
			n.store.ids.gate.Store(nil)
			close(ch)
		})
	}
	// Before the node's stop, which t.Cleanup runs later.
	t.Cleanup(release)
	return release
}

// rulePicks applies the rule to the server's objects now.
func rulePicks(t *testing.T, cli *client, cluster identity.ClusterInfo, sets []labels.Labels) []identity.NumericIdentity {
	t.Helper()
	c := newIdentityCache(slog.New(slog.DiscardHandler), cluster, cacheHooks{})
	var objs []any
	for _, o := range cli.identities(t) {
		objs = append(objs, &o)
	}
	if err := c.Replace(objs, "1"); err != nil {
		t.Fatal(err)
	}
	out := make([]identity.NumericIdentity, len(sets))
	for i, l := range sets {
		if e := c.lookup(l.Canonical()); e != nil {
			out[i] = e.id
		}
	}
	return out
}

// TestDuplicatesOneAnswer: label sets that Cilium agents created twice or
// three times, at random IDs, some in the same second. Three identityd
// nodes whose caches differ at the moment they allocate (node-a's watch is
// held before any object exists, node-b's after the first object of each
// set, node-c starts after all) allocate every set, a and b at once in the
// same order, c in another: every node answers the rule's ID for every
// set. node-a, seeing nothing, creates an object of every set on its probe
// sequence, seconds younger than Cilium's: within the head start of the
// sequence's objects, the rule's pick, which b and c, whose caches show
// Cilium's young objects first, must find at the server.
func TestDuplicatesOneAnswer(t *testing.T) {
	t.Parallel()
	setCount := 200
	if testing.Short() {
		setCount = 80
	}
	srv := startServer(t)
	rc := srv.RESTConfig()
	cli := newClient(t, rc)
	cluster := identity.ClusterInfo{Name: "default"}
	w := newCiliumWriter(t, cli, cluster)
	sets := make([]labels.Labels, setCount)
	for i := range sets {
		sets[i] = labels.MustParse(fmt.Sprintf("k8s:app=dup-%d", i), "k8s:io.kubernetes.pod.namespace=dup")
	}
	a := startNode(t, rc, "node-a")
	b := startNode(t, rc, "node-b")
	releaseA := holdWatch(t, a)

	first := make([]identity.NumericIdentity, setCount)
	for i, l := range sets {
		first[i] = w.create(l)
		if i%4 == 0 {
			// A race of Cilium agents that node-b sees whole.
			w.create(l)
		}
	}
	require(t, 30*time.Second, func() error {
		for _, id := range first {
			if b.store.ids.get(id) == nil {
				return fmt.Errorf("node-b has not seen %d yet", id)
			}
		}
		return nil
	})
	releaseB := holdWatch(t, b)
	for i, l := range sets {
		w.create(l)
		if i%3 == 0 {
			w.create(l)
		}
	}
	c := startNode(t, rc, "node-c")
	want := rulePicks(t, cli, cluster, sets)
	differ := 0
	for i, l := range sets {
		if e := b.store.ids.lookup(l.Canonical()); e == nil || e.id != want[i] {
			differ++
		}
	}
	t.Logf("%d label sets, %d CiliumIdentity objects; node-a's cache shows none of them, node-b's cache picks another than the rule for %d",
		setCount, len(cli.identities(t)), differ)

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	shuffled := make([]int, setCount)
	for i := range shuffled {
		shuffled[i] = i
	}
	rand.New(rand.NewPCG(1, 1)).Shuffle(setCount, func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
	cSets := make([]labels.Labels, setCount)
	for i, j := range shuffled {
		cSets[i] = sets[j]
	}
	var got [3][]identity.NumericIdentity
	var errs [3]error
	var cGot []identity.NumericIdentity
	var wg sync.WaitGroup
	wg.Go(func() { got[0], errs[0] = allocateAll(ctx, a, sets, 16) })
	wg.Go(func() { got[1], errs[1] = allocateAll(ctx, b, sets, 16) })
	wg.Go(func() { cGot, errs[2] = allocateAll(ctx, c, cSets, 16) })
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	got[2] = make([]identity.NumericIdentity, setCount)
	for i, j := range shuffled {
		got[2][j] = cGot[i]
	}
	// The rule on the objects there are now: node-a's creates, and any
	// other node's, came after the first look.
	want = rulePicks(t, cli, cluster, sets)
	wrong := 0
	for n, name := range []string{"node-a", "node-b", "node-c"} {
		for i, l := range sets {
			if got[n][i] != want[i] {
				if wrong++; wrong <= 10 {
					t.Errorf("%s answers %d for %s, the rule %d", name, got[n][i], l, want[i])
				}
			}
		}
	}
	if wrong > 0 {
		t.Fatalf("%d answers of %d differ from the rule's", wrong, 3*setCount)
	}
	t.Logf("listings of a label set's objects: node-a %d, node-b %d, node-c %d; node-a used another object than it found or created for %d sets",
		a.store.stats.listings.Load(), b.store.stats.listings.Load(), c.store.stats.listings.Load(), a.store.stats.repicked.Load())

	// Once their watches catch up, every node's cache agrees, and none
	// holds a label set under another ID than the rule's.
	releaseA()
	releaseB()
	require(t, time.Minute, func() error {
		for _, n := range []*testNode{a, b, c} {
			for i, l := range sets {
				if id, ok := n.store.LookupByLabels(l); !ok || id != want[i] {
					return fmt.Errorf("node %s looks %s up as %d, want %d", n.name, l, id, want[i])
				}
			}
			if h := n.store.splits.held.Load(); h != 0 {
				return fmt.Errorf("node %s reports %d label sets held split", n.name, h)
			}
		}
		return nil
	})
}

// splitErrorLog records the Error records, message and attributes.
type splitErrorLog struct {
	mu   sync.Mutex
	recs []string
}

func (l *splitErrorLog) Enabled(context.Context, slog.Level) bool { return true }
func (l *splitErrorLog) Handle(_ context.Context, r slog.Record) error {
	if r.Level >= slog.LevelError {
		var sb strings.Builder
		sb.WriteString(r.Message)
		r.Attrs(func(a slog.Attr) bool {
			fmt.Fprintf(&sb, " %s=%v", a.Key, a.Value)
			return true
		})
		l.mu.Lock()
		l.recs = append(l.recs, sb.String())
		l.mu.Unlock()
	}
	return nil
}
func (l *splitErrorLog) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *splitErrorLog) WithGroup(string) slog.Handler      { return l }

func (l *splitErrorLog) find(parts ...string) string {
	l.mu.Lock()
	defer l.mu.Unlock()
next:
	for _, r := range l.recs {
		for _, p := range parts {
			if !strings.Contains(r, p) {
				continue next
			}
		}
		return r
	}
	return ""
}

// TestSplitConverges forces a split: node-a creates X, a label set's
// object on its probe sequence; a writer creates Y further along the
// sequence, within the stretch where the rule ranks objects alike
// (seqReach); X is deleted behind the nodes' backs and node-a, which uses
// it, creates it again, now younger than Y. The rule picks Y from then on: node-b, and node-a once
// its holders released X, get Y; until then node-a keeps X and reports
// the split (log naming both IDs, metric, a health message of
// identity-splits that says degraded) while it stays ready: its health
// level stays OK, since the node serves and the split converges.
func TestSplitConverges(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	rc := srv.RESTConfig()
	cli := newClient(t, rc)
	cluster := identity.ClusterInfo{Name: "default"}
	logged := &splitErrorLog{}
	var healthA *cell.SimpleHealth
	a := startNode(t, rc, "node-a", func(o *nodeOpts) {
		o.log = slog.New(slog.NewMultiHandler(hivetest.Logger(t).Handler(), logged))
		o.cells = []cell.Cell{cell.SimpleHealthCell, cell.Invoke(func(h *cell.SimpleHealth) { healthA = h })}
	})
	b := startNode(t, rc, "node-b")
	lbls := labels.MustParse("k8s:app=split", "k8s:io.kubernetes.pod.namespace=prod")

	x, created := a.allocate(t, lbls)
	if !created {
		t.Fatalf("node-a adopted %d, want a new object", x)
	}
	p := idprobe.New(lbls.Canonical(), cluster)
	pos, _ := p.Position(x)
	y := p.Slot(pos + 1)
	objLabels, _ := objectLabels(lbls)
	cli.create(t, &CiliumIdentity{ObjectMeta: metav1.ObjectMeta{Name: y.String(), Labels: objLabels}, SecurityLabels: securityLabels(lbls)})
	objY, err := cli.identity(t, y)
	if err != nil {
		t.Fatal(err)
	}
	for time.Since(objY.CreationTimestamp.Time) < 1200*time.Millisecond {
		time.Sleep(50 * time.Millisecond)
	}
	if err := cli.cilium.Delete().Resource("ciliumidentities").Name(x.String()).Do(context.Background()).Error(); err != nil {
		t.Fatal(err)
	}
	splits := func() (cell.Level, string) {
		scope := healthA.GetChild("job-identity-splits")
		if scope == nil {
			return "", "no health scope job-identity-splits"
		}
		scope.Lock()
		defer scope.Unlock()
		return scope.Level, scope.Status + " " + fmt.Sprint(scope.Error)
	}
	require(t, 30*time.Second, func() error {
		if err := cli.holds(t, x, lbls); err != nil {
			return err
		}
		if level, status := splits(); level != cell.StatusOK || !strings.HasPrefix(status, "Degraded, serving: global label sets this node uses under another ID than the nodes that allocate them now: 1;") ||
			!strings.Contains(status, fmt.Sprintf("this node %d, the rule %d", x, y)) {
			return fmt.Errorf("identity-splits health %s %q, want OK (ready) with a message that says degraded and names both IDs", level, status)
		}
		if rec := logged.find("rule picks the other", fmt.Sprintf("this node %d, the rule %d", x, y)); rec == "" {
			return fmt.Errorf("no error log names %d and %d", x, y)
		}
		return nil
	})
	expectSamples(t, samples(t, a.store), map[string]float64{
		"identityd_crd_split_label_sets_held":       1,
		"identityd_crd_split_label_sets_held_total": 1,
	})

	// New users: node-b allocates the rule's; node-a's holders keep X.
	if got, _ := b.allocate(t, lbls); got != y {
		t.Errorf("node-b allocated %d, want the rule's %d", got, y)
	}
	if a.refs.ByID(x) == nil {
		t.Fatalf("node-a no longer holds %d", x)
	}
	if id, _ := a.store.LookupByLabels(lbls); id != y {
		t.Errorf("node-a looks the label set up as %d, want the rule's %d", id, y)
	}

	// node-a's holders release X: the report ends, and its next user
	// gets Y.
	a.release(t, x)
	require(t, 20*time.Second, func() error {
		if level, status := splits(); level != cell.StatusOK || strings.HasPrefix(status, "Degraded") {
			return fmt.Errorf("identity-splits health %s %q after the release", level, status)
		}
		return nil
	})
	expectSamples(t, samples(t, a.store), map[string]float64{
		"identityd_crd_split_label_sets_held":       0,
		"identityd_crd_split_label_sets_held_total": 1,
	})
	if got, _ := a.allocate(t, lbls); got != y {
		t.Errorf("node-a allocated %d after the release, want the rule's %d", got, y)
	}
}

// writeLate stores, straight in the API server's etcd, a copy of the
// object of from under the name of id, with from's creationTimestamp: an
// object created in that second whose write reached etcd, and so every
// watch, only now (a create the API server stamped, then wrote seconds
// later). Like the API server's create, it writes only a name that holds
// nothing; false when the name holds an object.
func writeLate(t *testing.T, srv *k8stest.Server, from, id identity.NumericIdentity) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	etcd := srv.EtcdCluster().Client(t)
	dir := srv.EtcdPrefix() + "/" + CiliumGroup + "/ciliumidentities/"
	got, err := etcd.Get(ctx, dir+from.String())
	if err != nil || len(got.Kvs) != 1 {
		t.Fatalf("reading %s%d from etcd: %v (%d keys)", dir, from, err, len(got.Kvs))
	}
	var obj map[string]any
	if err := json.Unmarshal(got.Kvs[0].Value, &obj); err != nil {
		t.Fatalf("%s%d does not hold JSON: %v", dir, from, err)
	}
	meta, _ := obj["metadata"].(map[string]any)
	if meta == nil || meta["creationTimestamp"] == nil {
		t.Fatalf("%s%d has no metadata.creationTimestamp: %s", dir, from, got.Kvs[0].Value)
	}
	meta["name"], meta["uid"] = id.String(), string(uuid.NewUUID())
	val, err := json.Marshal(obj)
	if err != nil {
		t.Fatal(err)
	}
	key := dir + id.String()
	res, err := etcd.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).Then(clientv3.OpPut(key, string(val))).Commit()
	if err != nil {
		t.Fatalf("writing %s: %v", key, err)
	}
	return res.Succeeded
}

// TestTieSeenLate is the tie of two identityd nodes beside a Cilium agent:
// an agent creates a label set's object off its probe sequence, and node-b,
// whose cache shows only that one, allocates the set; node-a's object of
// the set on the sequence, stamped in the same second, reaches the API
// server's etcd only after node-b answered (writeLate: a create the server
// was slow to write). node-a, whose cache then shows both, allocates the
// set: both nodes must answer the same ID, and it must be the rule's on
// the server's objects. Deciding on a listing made after the creation
// second, as before, node-b took Cilium's object and node-a, by the tie,
// its own, for every set.
func TestTieSeenLate(t *testing.T) {
	t.Parallel()
	const setCount = 3
	srv := startServer(t)
	rc := srv.RESTConfig()
	cli := newClient(t, rc)
	cluster := identity.ClusterInfo{Name: "default"}
	a := startNode(t, rc, "node-a")
	b := startNode(t, rc, "node-b")
	sets := make([]labels.Labels, setCount)
	cilium := make([]identity.NumericIdentity, setCount)
	for i := range sets {
		sets[i] = labels.MustParse(fmt.Sprintf("k8s:app=tie-%d", i), "k8s:io.kubernetes.pod.namespace=tie")
		// Far along the sequence, as a Cilium agent's random ID is.
		cilium[i] = idprobe.New(sets[i].Canonical(), cluster).Slot(1000 + uint64(i))
		objLabels, _ := objectLabels(sets[i])
		cli.create(t, &CiliumIdentity{ObjectMeta: metav1.ObjectMeta{Name: cilium[i].String(), Labels: objLabels}, SecurityLabels: securityLabels(sets[i])})
	}
	require(t, 30*time.Second, func() error {
		for _, id := range cilium {
			if b.store.ids.get(id) == nil {
				return fmt.Errorf("node-b has not seen %d yet", id)
			}
		}
		return nil
	})
	late := 0
	for i, l := range sets {
		idB, _ := b.allocate(t, l)
		walk := idprobe.New(l.Canonical(), cluster).Slot(0)
		if writeLate(t, srv, cilium[i], walk) {
			late++
		}
		// node-a's cache shows every object of the set before it
		// allocates.
		require(t, 30*time.Second, func() error {
			for _, o := range cli.identities(t) {
				if id, _ := parseName(o.Name); a.store.ids.get(id) == nil {
					return fmt.Errorf("node-a has not seen %s yet", o.Name)
				}
			}
			return nil
		})
		idA, _ := a.allocate(t, l)
		if idA != idB {
			t.Errorf("%s: node-a answers %d, node-b %d (Cilium's object %d, the sequence's first slot %d)", l, idA, idB, cilium[i], walk)
		}
		if want := rulePicks(t, cli, cluster, sets[i:i+1])[0]; idB != want {
			t.Errorf("%s: node-b answers %d, the rule on the server's objects %d", l, idB, want)
		}
	}
	t.Logf("%d of %d objects on the sequence written late", late, setCount)
}

// serverRequests returns the API server's count of requests for
// CiliumIdentity objects by verb, watches left out (their count moves when
// one ends).
func serverRequests(tb testing.TB, srv *k8stest.Server) map[string]float64 {
	tb.Helper()
	return serverRequestsFor(tb, srv, "ciliumidentities")
}

// serverRequestsFor is serverRequests for the requests on resource.
func serverRequestsFor(tb testing.TB, srv *k8stest.Server, resource string) map[string]float64 {
	tb.Helper()
	raw, err := k8stest.GetRaw(context.Background(), srv.RESTConfig(), "/metrics")
	if err != nil {
		tb.Fatalf("reading the API server's metrics: %v", err)
	}
	out := map[string]float64{}
	for line := range strings.Lines(string(raw)) {
		if !strings.HasPrefix(line, "apiserver_request_total{") || !strings.Contains(line, `resource="`+resource+`"`) {
			continue
		}
		_, rest, _ := strings.Cut(line, `verb="`)
		verb, _, _ := strings.Cut(rest, `"`)
		fields := strings.Fields(line)
		v, err := strconv.ParseFloat(fields[len(fields)-1], 64)
		if err != nil {
			tb.Fatalf("metrics line %q: %v", line, err)
		}
		if verb != "WATCH" {
			out[verb] += v
		}
	}
	return out
}

// TestAdoptDuplicatesRequests: a node that starts after the objects of
// its label sets exist, half of them duplicated (the other object at a
// random ID, as a Cilium agent makes one, older by a second than the one
// on the sequence for a quarter, younger for another quarter), a few
// marked, adopts each set with at most one request (the removal of a
// mark), and no listing, counted at the API server, without waking the
// identity-splits job, whose look goes over every split label set; and
// answers the rule's ID for every set. Deciding a duplicated set on a listing of its
// objects, as before, cost a listing per set whose older object is off
// the sequence, each a scan of every object at the server.
func TestAdoptDuplicatesRequests(t *testing.T) {
	t.Parallel()
	setCount := 200
	if testing.Short() {
		setCount = 80
	}
	srv := startServer(t)
	rc := srv.RESTConfig()
	cli := newClient(t, rc)
	cluster := identity.ClusterInfo{Name: "default"}
	w := newCiliumWriter(t, cli, cluster)
	sets := make([]labels.Labels, setCount)
	for i := range sets {
		sets[i] = labels.MustParse(fmt.Sprintf("k8s:app=late-%d", i), "k8s:io.kubernetes.pod.namespace=late")
	}
	// The objects a node's walk places: the first slot of each set's
	// sequence that no other holds.
	placed := func(l labels.Labels) identity.NumericIdentity {
		p := idprobe.New(l.Canonical(), cluster)
		for i := uint64(0); ; i++ {
			if id := p.Slot(i); !w.used[id] {
				w.used[id] = true
				objLabels, _ := objectLabels(l)
				cli.create(t, &CiliumIdentity{ObjectMeta: metav1.ObjectMeta{Name: id.String(), Labels: objLabels}, SecurityLabels: securityLabels(l)})
				return id
			}
		}
	}
	var objects int
	for i, l := range sets {
		if i%4 == 0 {
			w.create(l)
			objects++
		}
	}
	time.Sleep(1100 * time.Millisecond)
	marked := 0
	for i, l := range sets {
		id := placed(l)
		objects++
		if i%8 == 2 {
			cli.mark(t, id)
			marked++
		}
		if i%4 == 1 {
			w.create(l)
			objects++
		}
	}
	late := startNode(t, rc, "node-late")
	require(t, 30*time.Second, func() error {
		if objs, _ := late.store.ids.snapshot(); len(objs) != objects {
			return fmt.Errorf("node-late's cache shows %d of %d objects", len(objs), objects)
		}
		return nil
	})
	before := serverRequests(t, srv)
	looks := late.store.splits.looks.Load()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	got, err := allocateAll(ctx, late, sets, 8)
	if err != nil {
		t.Fatal(err)
	}
	after := serverRequests(t, srv)
	// Nor a look of the identity-splits job over every split label set
	// per adoption: the node holds none of them under another ID.
	if n := late.store.splits.looks.Load() - looks; n > 1 {
		t.Errorf("the identity-splits job looked over the split label sets %d times while the node adopted %d sets, want at most once", n, setCount)
	}
	total := 0.0
	for verb, v := range after {
		total += v - before[verb]
	}
	t.Logf("%d label sets (%d objects, %d marked) adopted with %.0f requests: %v before, %v after", setCount, objects, marked, total, before, after)
	if lists := after["LIST"] - before["LIST"]; lists != 0 {
		t.Errorf("%.0f listings of CiliumIdentity objects for %d adopted label sets, want none", lists, setCount)
	}
	if total > float64(marked) {
		t.Errorf("%.0f requests for %d adopted label sets of which %d marked, want at most one per marked set", total, setCount, marked)
	}
	want := rulePicks(t, cli, cluster, sets)
	for i, l := range sets {
		if got[i] != want[i] {
			t.Errorf("%s: node-late answers %d, the rule %d", l, got[i], want[i])
		}
	}
}

// TestMirroredObjectAdopted: in a migration from etcd, a node that decides
// identities in etcd (doublewrite-readkvstore) writes each one's
// CiliumIdentity at etcd's ID, off the label set's probe sequence; a node
// that reads the CRDs (doublewrite-readcrd) and allocates the set a moment
// later must answer that ID, as the node reading etcd does, and create
// nothing: an object identityd created ranks like one its walk placed.
// Ranked as a Cilium agent's young object, it lost to the object the
// second node created on the sequence.
func TestMirroredObjectAdopted(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	rc := srv.RESTConfig()
	cli := newClient(t, rc)
	cluster := identity.ClusterInfo{Name: "default"}
	kv := startNode(t, rc, "node-kvstore")
	crd := startNode(t, rc, "node-crd")
	for i := range 3 {
		l := labels.MustParse(fmt.Sprintf("k8s:app=mirrored-%d", i), "k8s:io.kubernetes.pod.namespace=migration")
		id := idprobe.New(l.Canonical(), cluster).Slot(1000 + uint64(i))
		ref := globalstore.NewReference(id, l, 0)
		kv.refs.Record(ref)
		if err := kv.store.Mirror(context.Background(), ref); err != nil {
			t.Fatal(err)
		}
		require(t, 30*time.Second, func() error {
			if crd.store.ids.get(id) == nil {
				return fmt.Errorf("node-crd has not seen %d yet", id)
			}
			return nil
		})
		if got, created := crd.allocate(t, l); got != id || created {
			t.Errorf("%s: node-crd answers %d (created %v), etcd's ID %d", l, got, created, id)
		}
	}
	if objs := cli.identities(t); len(objs) != 3 {
		t.Errorf("%d CiliumIdentity objects for 3 label sets, want 3", len(objs))
	}
}

// TestAdoptOnlyNodeWritesNoIdentity: a node given globalstore.AdoptOnly
// (operator mode) adopts the identities another node holds, never creates
// one (Allocate of an unknown label set fails with ErrNoIdentity), takes
// no marked identity (its writer removes the mark when it takes the label
// set up again), and leaves the mark on an identity it holds and a deleted
// one deleted: the writer that holds the label set does both.
func TestAdoptOnlyNodeWritesNoIdentity(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	rc := srv.RESTConfig()
	cli := newClient(t, rc)
	writer := startNode(t, rc, "adopt-only-writer")
	reader := startNode(t, rc, "adopt-only-reader", func(o *nodeOpts) {
		o.cells = append(o.cells, cell.Provide(func() globalstore.AdoptOnly { return true }))
	})
	set := func(name string) labels.Labels {
		return labels.MustParse("k8s:app=adopt-only-"+name, "k8s:io.kubernetes.pod.namespace=adopt")
	}
	objectsOf := func(l labels.Labels) (n int) {
		for _, o := range cli.identities(t) {
			if got, err := parseSecurityLabels(o.SecurityLabels); err == nil && got.Equal(l) {
				n++
			}
		}
		return n
	}
	ctx := t.Context()

	// No object of the label set: nothing is created.
	unknown := set("unknown")
	if _, _, err := reader.store.Allocate(ctx, unknown, reader.refs.Record); !errors.Is(err, globalstore.ErrNoIdentity) {
		t.Fatalf("Allocate of a label set without an object on an adopt-only node: %v, want ErrNoIdentity", err)
	}
	if n := objectsOf(unknown); n != 0 {
		t.Fatalf("the adopt-only node created %d objects of %s", n, unknown.Canonical())
	}

	// A marked identity is not taken until its writer takes it up.
	marked := set("marked")
	markedID, _ := writer.allocate(t, marked)
	writer.release(t, markedID)
	cli.mark(t, markedID)
	require(t, 30*time.Second, func() error {
		if e := reader.store.ids.get(markedID); e == nil || !e.marked() {
			return errors.New("the reader's cache does not show the mark yet")
		}
		return nil
	})
	if _, err := reader.store.Adopt(ctx, marked, reader.refs.Record); !errors.Is(err, globalstore.ErrNoIdentity) {
		t.Fatalf("Adopt of a marked identity on an adopt-only node: %v, want ErrNoIdentity", err)
	}
	if !cli.marked(t, markedID) {
		t.Fatalf("the adopt-only node removed the mark of %d", markedID)
	}
	if id, _ := writer.allocate(t, marked); id != markedID {
		t.Fatalf("the writer took %s up again as %d, want %d", marked.Canonical(), id, markedID)
	}
	require(t, 30*time.Second, func() error {
		id, _, err := reader.store.Allocate(ctx, marked, reader.refs.Record)
		if err != nil {
			return err
		}
		if id != markedID {
			t.Fatalf("the adopt-only node adopted %d, want %d", id, markedID)
		}
		return nil
	})

	// An identity the adopt-only node alone holds keeps its mark, and
	// stays deleted once deleted.
	held := set("held")
	heldID, _ := writer.allocate(t, held)
	// Once the reader's cache shows the writer's object.
	require(t, 30*time.Second, func() error {
		id, err := reader.store.Adopt(ctx, held, reader.refs.Record)
		if err != nil {
			return err
		}
		if id != heldID {
			t.Fatalf("Adopt of %s: %d, want %d", held.Canonical(), id, heldID)
		}
		return nil
	})
	writer.release(t, heldID)
	reader.store.writer.request(false)
	cli.nodeLists(t, "adopt-only-reader", markedID, heldID)
	cli.mark(t, heldID)
	time.Sleep(2 * time.Second)
	if !cli.marked(t, heldID) {
		t.Fatalf("the adopt-only node removed the mark of %d", heldID)
	}
	if err := cli.cilium.Delete().Resource("ciliumidentities").Name(heldID.String()).Do(ctx).Error(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Second)
	if _, err := cli.identity(t, heldID); !apierrors.IsNotFound(err) {
		t.Fatalf("CiliumIdentity %d after its delete: %v, want NotFound: the adopt-only node re-created it", heldID, err)
	}
}
