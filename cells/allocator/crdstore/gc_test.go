package crdstore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
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
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/allocator/globalstore/storetest"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/eventually"
	"github.com/identityd/identityd/internal/idprobe"
	"github.com/identityd/identityd/internal/testproc"
	"github.com/identityd/identityd/labels"
)

// gcCluster is the cluster of the collection tests: range 256..65535.
var gcCluster = identity.ClusterInfo{Name: "default", MaxConnectedClusters: 255}

// gcTestConfig collects on demand (the tests call collect) and deletes a
// marked identity a second after its mark.
var gcTestConfig = GCConfig{RateLimit: 1000, RateInterval: time.Second, HeartbeatTimeout: time.Second}

// gcNode is one store in a hive of its own, as one identityd node runs it.
type gcNode struct {
	*Store
	refs *storetest.Refs
	h    *hive.Hive
	log  *slog.Logger
	once sync.Once
}

// newGCNode builds the store of node on cfg, collecting with gc, in a hive
// of its own that cells join; the hive is not started, so that tests
// change the store first.
func newGCNode(t *testing.T, cfg *rest.Config, node string, gc GCConfig, cells ...cell.Cell) *gcNode {
	t.Helper()
	// Tests shorten the heartbeat timeout below what the cell allows:
	// the cell builds the collector's jobs at gc's interval, and the
	// test's settings replace its own before the start.
	if err := gc.validateBasic(); err != nil {
		t.Fatal(err)
	}
	stores := globalstore.DefaultConfig
	stores.IdentityGCInterval = gc.Interval
	n := &gcNode{refs: storetest.NewRefs(), log: hivetest.Logger(t, hivetest.LogLevel(slog.LevelWarn))}
	n.h = hive.New(append([]cell.Cell{
		job.Cell,
		cell.Provide(
			func() *rest.Config { return cfg },
			func() identity.ClusterInfo { return gcCluster },
			func() identity.NodeName { return identity.NodeName(node) },
			func() globalstore.Config { return stores },
			globalstore.NewSinks,
		),
		Cell,
		cell.Invoke(func(s *Store, sinks *globalstore.Sinks) {
			n.Store = s
			sinks.For(identity.AllocationModeCRD).Bind(nil, n.refs)
		}),
	}, cells...)...)
	hive.AddConfigOverride(n.h, func(c *Config) { *c = Config{IdentityNodeLeaseTTL: MinIdentityNodeLeaseTTL} })
	if err := n.h.Populate(n.log); err != nil {
		t.Fatal(err)
	}
	n.gc = newGCState(gc)
	return n
}

// start starts the node's hive; the test's end stops it.
func (n *gcNode) start(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	if err := n.h.Start(n.log, ctx); err != nil {
		t.Fatal(err)
	}
	if !n.ids.isSynced() {
		t.Fatal("the store's start returned before its first listing")
	}
	t.Cleanup(func() {
		if err := n.stop(); err != nil {
			t.Error(err)
		}
	})
}

// stop stops the node's hive, once.
func (n *gcNode) stop() (err error) {
	n.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		err = n.h.Stop(n.log, ctx)
	})
	return err
}

// startGCNode starts the store of node; the test's end stops it.
func startGCNode(t *testing.T, cfg *rest.Config, node string, gc GCConfig) *gcNode {
	t.Helper()
	n := newGCNode(t, cfg, node, gc)
	n.start(t)
	return n
}

func (n *gcNode) allocate(t *testing.T, lbls labels.Labels) identity.NumericIdentity {
	t.Helper()
	id, _, err := n.Allocate(t.Context(), lbls, n.refs.Record)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func (n *gcNode) release(t *testing.T, id identity.NumericIdentity) {
	t.Helper()
	ref := n.refs.Remove(id)
	if ref == nil {
		t.Fatalf("node %s holds no reference to %d", n.node, id)
	}
	if err := n.Release(t.Context(), ref); err != nil {
		t.Fatal(err)
	}
}

// nodeRecord reads node's IdentityNode; nil when there is none.
func nodeRecord(t *testing.T, s *Store, node string) *IdentityNode {
	t.Helper()
	var obj IdentityNode
	err := s.nodeClient.Get().Resource("identitynodes").Name(node).Do(t.Context()).Into(&obj)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	return &obj
}

// waitListed waits until node's IdentityNode lists id, or does not.
func waitListed(t *testing.T, s *Store, node string, id identity.NumericIdentity, listed bool) {
	t.Helper()
	eventually.True(t, fmt.Sprintf("IdentityNode %s lists %d: %v", node, id, listed), func() bool {
		n := nodeRecord(t, s, node)
		return n != nil && slices.Contains(n.Spec.Identities, uint32(id)) == listed
	})
}

// readIdentity reads id's object; nil when there is none.
func readIdentity(t *testing.T, s *Store, id identity.NumericIdentity) *CiliumIdentity {
	t.Helper()
	var obj CiliumIdentity
	err := s.ciliumClient.Get().Resource("ciliumidentities").Name(id.String()).Do(t.Context()).Into(&obj)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	return &obj
}

// markOf returns id's heartbeat mark, failing the test when the object is
// gone.
func markOf(t *testing.T, s *Store, id identity.NumericIdentity) (string, bool) {
	t.Helper()
	obj := readIdentity(t, s, id)
	if obj == nil {
		t.Fatalf("identity %d was deleted", id)
	}
	v, ok := obj.Annotations[HeartbeatAnnotation]
	return v, ok
}

// createIdentity creates id for lbls as Cilium writes it, with the
// heartbeat mark when mark is not empty.
func createIdentity(t *testing.T, s *Store, id identity.NumericIdentity, lbls labels.Labels, mark string) {
	t.Helper()
	obj := &CiliumIdentity{
		TypeMeta:       metav1.TypeMeta{APIVersion: CiliumGroup + "/" + CiliumVersion, Kind: "CiliumIdentity"},
		ObjectMeta:     metav1.ObjectMeta{Name: id.String()},
		SecurityLabels: securityLabels(lbls),
	}
	if mark != "" {
		obj.Annotations = map[string]string{HeartbeatAnnotation: mark}
	}
	if err := s.ciliumClient.Post().Resource("ciliumidentities").Body(obj).Do(t.Context()).Error(); err != nil {
		t.Fatal(err)
	}
}

// runGC runs one collection on s once its cache shows what the API server
// holds: the collector decides on the cache, and a test that wrote
// objects just before wants the run to see them.
func runGC(t *testing.T, s *Store) globalstore.GCResult {
	t.Helper()
	waitCacheCurrent(t, s)
	res, err := s.collect(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// waitCacheCurrent waits until s's cache of identities holds every
// CiliumIdentity object of its range at the resourceVersion a consistent
// listing gives, and nothing else.
func waitCacheCurrent(t *testing.T, s *Store) {
	t.Helper()
	eventually.True(t, "the cache of identities shows the API server's objects", func() bool {
		var list CiliumIdentityList
		if err := s.ciliumClient.Get().Resource("ciliumidentities").Do(t.Context()).Into(&list); err != nil {
			t.Fatal(err)
		}
		want := map[identity.NumericIdentity]string{}
		for i := range list.Items {
			if e, err := s.ids.parse(&list.Items[i]); err == nil {
				want[e.id] = list.Items[i].ResourceVersion
			}
		}
		s.ids.mu.RLock()
		defer s.ids.mu.RUnlock()
		if len(s.ids.byID) != len(want) {
			return false
		}
		for id, rv := range want {
			if e := s.ids.byID[id]; e == nil || e.obj.ResourceVersion != rv {
				return false
			}
		}
		return true
	})
}

// waitTimeout waits until a mark made now is older than the heartbeat
// timeout.
// passTime moves the collector's clock of each store on by d, as if d had
// passed: the tests do not sleep through heartbeat timeouts.
func passTime(d time.Duration, stores ...*Store) {
	for _, s := range stores {
		clock := s.gc.clock
		s.gc.clock = func() time.Time { return clock().Add(d) }
	}
}

// passTimeout is passTime of cfg's heartbeat timeout, and a little more.
func passTimeout(cfg GCConfig, stores ...*Store) {
	passTime(cfg.HeartbeatTimeout+50*time.Millisecond, stores...)
}

func mustLabels(t *testing.T, s ...string) labels.Labels {
	t.Helper()
	l, err := labels.Parse(s...)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// TestGCMarksThenDeletesUnused: an identity no node uses gets the heartbeat
// mark (RFC 3339 with nanoseconds), stays while the mark is younger than
// the timeout, and is deleted after it.
func TestGCMarksThenDeletesUnused(t *testing.T) {
	srv := serialServer(t)
	a := startGCNode(t, srv.RESTConfig(), "node-a", gcTestConfig)
	id := a.allocate(t, mustLabels(t, "k8s:app=unused"))
	a.release(t, id)
	waitListed(t, a.Store, "node-a", id, false)

	before := time.Now()
	if res := runGC(t, a.Store); res.Marked != 1 || res.Deleted != 0 {
		t.Fatalf("first run: %+v, want one marked", res)
	}
	mark, ok := markOf(t, a.Store, id)
	if !ok {
		t.Fatal("the unused identity has no heartbeat mark")
	}
	at, err := time.Parse(time.RFC3339Nano, mark)
	if err != nil || at.Before(before.Add(-time.Second)) || at.After(time.Now().Add(time.Second)) {
		t.Fatalf("mark %q: not the RFC 3339 time of the run (%v)", mark, err)
	}
	// Younger than the timeout: kept, mark unchanged.
	if res := runGC(t, a.Store); res.Deleted != 0 || res.Marked != 0 {
		t.Fatalf("run within the timeout: %+v, want nothing done", res)
	}
	if m, _ := markOf(t, a.Store, id); m != mark {
		t.Fatalf("mark changed from %q to %q", mark, m)
	}
	passTimeout(gcTestConfig, a.Store)
	if res := runGC(t, a.Store); res.Deleted != 1 {
		t.Fatalf("run after the timeout: %+v, want one deleted", res)
	}
	if readIdentity(t, a.Store, id) != nil {
		t.Fatal("the identity is still there")
	}
	if st := a.gcStats(); st.Marked != 1 || st.Deleted != 1 || st.Runs != 3 || st.Failed != 0 {
		t.Fatalf("stats %+v", st)
	}
}

// TestGCKeepsUsed: an identity that a live IdentityNode lists is never
// marked by another node's collection, and a mark someone else set on it
// does not get it deleted.
func TestGCKeepsUsed(t *testing.T) {
	srv := serialServer(t)
	a := startGCNode(t, srv.RESTConfig(), "node-a", gcTestConfig)
	b := startGCNode(t, srv.RESTConfig(), "node-b", gcTestConfig)
	id := a.allocate(t, mustLabels(t, "k8s:app=used"))
	waitListed(t, a.Store, "node-a", id, true)
	for range 3 {
		res := runGC(t, b.Store)
		if res.Marked != 0 || res.Deleted != 0 || res.KeptUsed != 1 {
			t.Fatalf("run on node-b: %+v, want the identity kept as used", res)
		}
		if _, ok := markOf(t, b.Store, id); ok {
			t.Fatal("an identity a live node lists got the heartbeat mark")
		}
		passTimeout(gcTestConfig, b.Store)
	}
}

// TestGCExpiredNodeStopsProtecting is the SIGKILL case at store level: a
// node's store stops without releasing anything; while its IdentityNode's
// lease runs its identities are kept; once the lease has ended (aged here
// by rewriting renewTime, as a node that stopped renewing leaves it) the
// collection marks and deletes them, and a lease later deletes the record.
func TestGCExpiredNodeStopsProtecting(t *testing.T) {
	srv := serialServer(t)
	a := startGCNode(t, srv.RESTConfig(), "node-a", gcTestConfig)
	b := startGCNode(t, srv.RESTConfig(), "node-b", gcTestConfig)
	id := a.allocate(t, mustLabels(t, "k8s:app=killed"))
	waitListed(t, b.Store, "node-a", id, true)
	if err := a.stop(); err != nil {
		t.Fatal(err)
	}
	if res := runGC(t, b.Store); res.Marked != 0 || res.KeptUsed != 1 {
		t.Fatalf("run while node-a's lease lasts: %+v, want its identity kept", res)
	}

	age := func(ago time.Duration) {
		t.Helper()
		n := nodeRecord(t, b.Store, "node-a")
		if n == nil {
			t.Fatal("node-a's IdentityNode is gone")
		}
		patch := fmt.Appendf(nil, `{"spec":{"renewTime":%q}}`, metav1.NewMicroTime(time.Now().Add(-ago)).Format(metav1.RFC3339Micro))
		if err := b.nodeClient.Patch(types.MergePatchType).Resource("identitynodes").Name("node-a").Body(patch).Do(t.Context()).Error(); err != nil {
			t.Fatal(err)
		}
	}
	lease := MinIdentityNodeLeaseTTL
	// The lease ended a second ago, but not a lease ago: its uses no
	// longer count, and the record stays.
	age(lease + time.Second)
	if res := runGC(t, b.Store); res.Marked != 1 || res.NodesDeleted != 0 {
		t.Fatalf("run after node-a's lease: %+v, want its identity marked and its record kept", res)
	}
	passTimeout(gcTestConfig, b.Store)
	if res := runGC(t, b.Store); res.Deleted != 1 {
		t.Fatalf("run after the timeout: %+v, want node-a's identity deleted", res)
	}
	if nodeRecord(t, b.Store, "node-a") == nil {
		t.Fatal("node-a's record was deleted less than a lease after its lease ended")
	}
	age(2*lease + time.Second)
	if res := runGC(t, b.Store); res.NodesDeleted != 1 {
		t.Fatalf("run a lease after node-a's lease: %+v, want its record deleted", res)
	}
	if nodeRecord(t, b.Store, "node-a") != nil {
		t.Fatal("node-a's record is still there")
	}
	if nodeRecord(t, b.Store, "node-b") == nil {
		t.Fatal("the collecting node's own record was deleted")
	}
}

// TestGCDeleteLosesToUnmark: a use that removes the mark between the
// collection's listing and its delete wins: the delete's preconditions
// (UID and resourceVersion) refuse it and the identity stays. Deleting
// without them makes this test fail (checked).
func TestGCDeleteLosesToUnmark(t *testing.T) {
	srv := serialServer(t)
	a := startGCNode(t, srv.RESTConfig(), "node-a", gcTestConfig)
	b := startGCNode(t, srv.RESTConfig(), "node-b", gcTestConfig)
	lbls := mustLabels(t, "k8s:app=adopted-late")
	id := a.allocate(t, lbls)
	a.release(t, id)
	waitListed(t, a.Store, "node-a", id, false)
	if res := runGC(t, a.Store); res.Marked != 1 {
		t.Fatalf("first run: %+v, want one marked", res)
	}
	passTimeout(gcTestConfig, a.Store)

	// Between the listing and the delete, node-b adopts the identity:
	// its allocation removes the mark.
	var adopted identity.NumericIdentity
	a.gc.beforeDelete = func(o *gcObject) {
		eventually.True(t, "node-b's cache shows the mark", func() bool {
			e := b.ids.get(o.id)
			return e != nil && e.marked()
		})
		adopted = b.allocate(t, lbls)
	}
	res := runGC(t, a.Store)
	if adopted != id {
		t.Fatalf("node-b adopted %d, want %d", adopted, id)
	}
	if res.Deleted != 0 || res.Skipped != 1 {
		t.Fatalf("run: %+v, want the delete skipped", res)
	}
	if _, ok := markOf(t, a.Store, id); ok {
		t.Fatal("the adopted identity is still marked")
	}
	if st := a.gcStats(); st.Skipped != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// TestGCFence: an identity at position 0 of another label set's probe
// sequence, whose identity sits at position 1 because of it, is kept
// while that identity is young, though nobody uses it, and a mark another
// collector set on it is removed; once the later identity is older than
// the heartbeat timeout, every cache shows it, and the first slot is
// collected while the later identity lives. Without the fence rule the
// first part fails, with the fence of every object, young or old, the
// second (both checked).
func TestGCFence(t *testing.T) {
	srv := serialServer(t)
	cfg := gcTestConfig
	// Long enough for the first runs to happen while later is young on a
	// loaded machine.
	cfg.HeartbeatTimeout = 4 * time.Second
	a := startGCNode(t, srv.RESTConfig(), "node-a", cfg)
	// Beside Cilium, whose operator may collect too.
	a.cfg.IdentityGCCiliumAgents = true
	later := mustLabels(t, "k8s:app=later")
	p := idprobe.New(later.Canonical(), gcCluster)
	// Another label set holds the first slot of later's sequence.
	first := p.Slot(0)
	createIdentity(t, a.Store, first, mustLabels(t, "k8s:app=first"), "")
	eventually.True(t, "the cache shows the first slot held", func() bool { return a.ids.get(first) != nil })
	id := a.allocate(t, later)
	if id != p.Slot(1) {
		t.Fatalf("later got %d, want %d, the second slot of its sequence", id, p.Slot(1))
	}
	obj := readIdentity(t, a.Store, id)
	if obj == nil {
		t.Fatal("later's object is gone")
	}
	oldAt := obj.CreationTimestamp.Add(cfg.HeartbeatTimeout + time.Second)

	if res := runGC(t, a.Store); res.Marked != 0 || res.KeptFenced != 1 || res.KeptUsed != 1 {
		t.Fatalf("run while later is young: %+v, want the first slot kept by the fence", res)
	}
	if _, ok := markOf(t, a.Store, first); ok {
		t.Fatal("the fenced identity got the heartbeat mark")
	}
	// A mark another collector set on the fenced identity is removed.
	patch := fmt.Appendf(nil, `{"metadata":{"annotations":{%q:%q}}}`, HeartbeatAnnotation, time.Now().Add(-time.Hour).UTC().Format(time.RFC3339Nano))
	if err := a.ciliumClient.Patch(types.MergePatchType).Resource("ciliumidentities").Name(first.String()).Body(patch).Do(t.Context()).Error(); err != nil {
		t.Fatal(err)
	}
	if res := runGC(t, a.Store); res.Deleted != 0 || res.Unmarked != 1 || res.KeptFenced != 1 {
		t.Fatalf("run with the fenced identity marked: %+v, want it unmarked and kept", res)
	}
	if _, ok := markOf(t, a.Store, first); ok {
		t.Fatal("the fenced identity's mark stayed")
	}

	// Later is old: every node's cache shows it, so nobody walks its
	// sequence, and the first slot is no longer fenced.
	passTime(time.Until(oldAt)+50*time.Millisecond, a.Store)
	if res := runGC(t, a.Store); res.Marked != 1 || res.KeptFenced != 0 || res.KeptUsed != 1 {
		t.Fatalf("run once later is old: %+v, want first marked, later kept as used", res)
	}
	passTimeout(cfg, a.Store)
	if res := runGC(t, a.Store); res.Deleted != 1 || res.KeptUsed != 1 {
		t.Fatalf("run after the timeout: %+v, want first deleted", res)
	}
	if readIdentity(t, a.Store, first) != nil {
		t.Fatal("first is still there")
	}
	// later keeps its ID: the cache shows its object, so the walk is not
	// needed.
	if got := a.allocate(t, later); got != id {
		t.Fatalf("later allocated again: %d, want %d", got, id)
	}
}

// TestGCGraceWithoutCilium: without Cilium agents, a released identity
// that no IdentityNode lists is deleted after the grace (half an interval,
// at least MinHeartbeatTimeout, which the test shortens), though the
// heartbeat timeout is an hour; beside Cilium agents it waits for the
// timeout. Without the grace the first part fails (checked).
func TestGCGraceWithoutCilium(t *testing.T) {
	srv := serialServer(t)
	cfg := gcTestConfig
	cfg.Interval, cfg.HeartbeatTimeout = time.Second, time.Hour
	for _, cilium := range []bool{false, true} {
		node := fmt.Sprintf("node-cilium-%v", cilium)
		n := newGCNode(t, srv.RESTConfig(), node, cfg)
		n.cfg.IdentityGCCiliumAgents = cilium
		n.gc.minGrace = 2 * time.Second
		n.start(t)
		id := n.allocate(t, mustLabels(t, fmt.Sprintf("k8s:app=grace-%v", cilium)))
		n.release(t, id)
		start := time.Now()
		if !cilium {
			eventually.True(t, "the released identity is deleted after the grace", func() bool { return readIdentity(t, n.Store, id) == nil })
			// Marked in one run, deleted in a later one a grace
			// after: within two intervals and the grace, plus the
			// reference write and a loaded machine.
			if d := time.Since(start); d < n.gc.minGrace || d > 2*cfg.Interval+n.gc.minGrace+5*time.Second {
				t.Fatalf("deleted %s after the release, want after the grace of %s and within two intervals more", d, n.gc.minGrace)
			}
			n.stop()
			continue
		}
		eventually.True(t, "the released identity is marked", func() bool { _, ok := markOf(t, n.Store, id); return ok })
		time.Sleep(3*cfg.Interval + n.gc.minGrace)
		if _, ok := markOf(t, n.Store, id); !ok {
			t.Fatal("the mark went")
		}
		n.stop()
	}
}

// TestGCRateLimit: deletions are paced at --identity-gc-rate-limit per
// --identity-gc-rate-interval.
func TestGCRateLimit(t *testing.T) {
	srv := serialServer(t)
	cfg := gcTestConfig
	cfg.RateLimit, cfg.RateInterval = 2, time.Second
	a := startGCNode(t, srv.RESTConfig(), "node-a", cfg)
	// Identities marked an hour ago, as a Cilium operator marks them.
	old := time.Now().Add(-time.Hour).UTC().Format(time.RFC3339Nano)
	const n = 5
	for i := range n {
		createIdentity(t, a.Store, identity.NumericIdentity(1000+i), mustLabels(t, fmt.Sprintf("k8s:app=paced-%d", i)), old)
	}
	start := time.Now()
	res := runGC(t, a.Store)
	elapsed := time.Since(start)
	if res.Deleted != n {
		t.Fatalf("run: %+v, want %d deleted", res, n)
	}
	// One at once, then one every half second.
	if want := time.Duration(n-1) * cfg.RateInterval / time.Duration(cfg.RateLimit); elapsed < want-100*time.Millisecond {
		t.Fatalf("%d deletions took %s, the limit allows them in no less than %s", n, elapsed, want)
	}
}

// TestGCMarksBesideDeletes: the marks a run writes do not take the paced
// deletes' turns. A run with 50 identities to delete at 50 a second and
// 600 to mark, their IDs interleaved, deletes at the rate limit's pace:
// its deletes span no more than the limit's 49 intervals and some room,
// whatever the marks cost. With the marks written in the deletes' loop,
// the span grows by the time of the marks in between (checked).
func TestGCMarksBesideDeletes(t *testing.T) {
	srv := serialServer(t)
	cfg := gcTestConfig
	cfg.RateLimit, cfg.RateInterval = 50, time.Second
	a := startGCNode(t, srv.RESTConfig(), "node-a", cfg)
	old := time.Now().Add(-time.Hour).UTC().Format(time.RFC3339Nano)
	const deletable, markable = 50, 600
	createSpaced(t, a.Store, 20000, deletable+markable, "paced-mark", func(i int) string {
		if i%13 == 0 && i/13 < deletable {
			return old
		}
		return ""
	})
	var times []time.Time
	a.gc.beforeDelete = func(*gcObject) { times = append(times, time.Now()) }
	start := time.Now()
	res := runGC(t, a.Store)
	if res.Deleted != deletable || res.Marked != markable {
		t.Fatalf("run: %+v, want %d deleted and %d marked", res, deletable, markable)
	}
	span := times[len(times)-1].Sub(times[0])
	pace := time.Duration(deletable-1) * cfg.RateInterval / time.Duration(cfg.RateLimit)
	t.Logf("%d deletes spanned %s (the limit's pace: %s), the run %s", deletable, span, pace, time.Since(start))
	if span > pace+400*time.Millisecond {
		t.Fatalf("%d deletes spanned %s, want the limit's %s and at most 400ms more", deletable, span, pace)
	}
}

// TestGCDeletesKeepPaceWithSlowAnswers: an API server that answers each
// delete in 60 ms does not lower the collector's pace below its limit of
// 50 a second (20 ms a delete): the limit paces the starts, and several
// deletes wait for their answers at once (about 3). With one delete at a
// time, one is (checked), and the 30 deletes take 30 answers, 1.8 s.
func TestGCDeletesKeepPaceWithSlowAnswers(t *testing.T) {
	srv := serialServer(t)
	cfg := gcTestConfig
	cfg.RateLimit, cfg.RateInterval = 50, time.Second
	slow, flight := slowAnswers(srv.RESTConfig(), 60*time.Millisecond, func(r *http.Request) bool { return r.Method == http.MethodDelete })
	a := startGCNode(t, slow, "node-a", cfg)
	old := time.Now().Add(-time.Hour).UTC().Format(time.RFC3339Nano)
	const n = 30
	for i := range n {
		// Every other ID, so that no object fences another.
		createIdentity(t, a.Store, identity.NumericIdentity(30000+2*i), mustLabels(t, fmt.Sprintf("k8s:app=slow-delete-%d", i)), old)
	}
	start := time.Now()
	res := runGC(t, a.Store)
	took := time.Since(start)
	if res.Deleted != n {
		t.Fatalf("run: %+v, want %d deleted", res, n)
	}
	pace := time.Duration(n-1) * cfg.RateInterval / time.Duration(cfg.RateLimit)
	t.Logf("%d deletes answered in 60 ms each took %s (the limit's pace: %s), at most %d in flight", n, took, pace, flight.most())
	if flight.most() < 2 {
		t.Fatalf("at most %d deletes awaited their answers at once, want several: one at a time, answers slower than the limit's pace lower it", flight.most())
	}
}

// TestGCMarksKeepPaceWithSlowAnswers: an API server that answers each
// patch in 60 ms does not hold a run's marks to one per answer: several
// marks (gcMarksInFlight) wait for their answers at once, so that 120
// identities to mark take a fraction of the 7.2 s that 120 answers one
// after the other take. With one mark at a time, one is (checked).
func TestGCMarksKeepPaceWithSlowAnswers(t *testing.T) {
	srv := serialServer(t)
	slow, flight := slowAnswers(srv.RESTConfig(), 60*time.Millisecond, func(r *http.Request) bool { return r.Method == http.MethodPatch })
	a := startGCNode(t, slow, "node-a", gcTestConfig)
	const n = 120
	createSpaced(t, a.Store, 40000, n, "slow-mark", nil)
	start := time.Now()
	res := runGC(t, a.Store)
	took := time.Since(start)
	if res.Marked != n {
		t.Fatalf("run: %+v, want %d marked", res, n)
	}
	serial := n * 60 * time.Millisecond
	t.Logf("%d marks answered in 60 ms each took %s (one after the other: %s), at most %d in flight", n, took, serial, flight.most())
	if flight.most() < gcMarksInFlight {
		t.Fatalf("at most %d marks awaited their answers at once, want %d", flight.most(), gcMarksInFlight)
	}
}

// TestGCListsNoIdentities: a run decides on the store's cache of
// identities and sends no listing of CiliumIdentity objects, however many
// there are: here 60 to mark and 20 to delete, all marked and deleted
// with no LIST of ciliumidentities at the API server from the run. With
// the run's own listing, it sends one per 500 objects (checked).
func TestGCListsNoIdentities(t *testing.T) {
	srv := serialServer(t)
	var lists atomic.Int64
	counted := rest.CopyConfig(srv.RESTConfig())
	counted.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return roundTripFunc(func(r *http.Request) (*http.Response, error) {
			if r.Method == http.MethodGet && strings.HasSuffix(r.URL.Path, "/ciliumidentities") && r.URL.Query().Get("watch") == "" {
				lists.Add(1)
			}
			return rt.RoundTrip(r)
		})
	})
	a := startGCNode(t, counted, "node-a", gcTestConfig)
	old := oldMark()
	const markable, deletable = 60, 20
	for i := range markable + deletable {
		mark := ""
		if i < deletable {
			mark = old
		}
		// Every other ID, so that no object fences another.
		createIdentity(t, a.Store, identity.NumericIdentity(45000+2*i), mustLabels(t, fmt.Sprintf("k8s:app=unlisted-%d", i)), mark)
	}
	waitCacheCurrent(t, a.Store)
	before := lists.Load()
	res, err := a.collect(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if res.Marked != markable || res.Deleted != deletable {
		t.Fatalf("run: %+v, want %d marked and %d deleted", res, markable, deletable)
	}
	if n := lists.Load() - before; n != 0 {
		t.Fatalf("the run listed the CiliumIdentity objects %d times, want none: it decides on the cache", n)
	}
}

// TestGCDeletesReachLimitWithSlowAnswers: on an API server that answers
// each delete in 250 ms, a collector limited to 200 deletes a second
// deletes at that pace: its deletes in flight follow the limit (up to 200
// at once here, the limit's deletes within a second), and at 200 a
// second about 50 wait for their 250 ms answers at once. With 8 deletes in
// flight (minDeletesInFlight), 8 at most are (checked), and 120 deletes
// take at least 120/8 answers, 3.75 s.
func TestGCDeletesReachLimitWithSlowAnswers(t *testing.T) {
	srv := serialServer(t)
	cfg := gcTestConfig
	cfg.RateLimit, cfg.RateInterval = 200, time.Second
	const answer = 250 * time.Millisecond
	slow, flight := slowAnswers(srv.RESTConfig(), answer, func(r *http.Request) bool {
		return r.Method == http.MethodDelete && strings.Contains(r.URL.Path, "/ciliumidentities/")
	})
	a := startGCNode(t, slow, "node-a", cfg)
	old := oldMark()
	const n = 120
	createSpaced(t, a.Store, 50000, n, "slow-limit", func(int) string { return old })
	waitCacheCurrent(t, a.Store)
	start := time.Now()
	res, err := a.collect(t.Context())
	took := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	if res.Deleted != n {
		t.Fatalf("run: %+v, want %d deleted", res, n)
	}
	pace := time.Duration(n-1) * cfg.RateInterval / time.Duration(cfg.RateLimit)
	t.Logf("%d deletes answered in %s each took %s (the limit's pace: %s), at most %d in flight of %d allowed", n, answer, took, pace, flight.most(), a.gc.deletesInFlight)
	if flight.most() <= 2*minDeletesInFlight {
		t.Fatalf("at most %d deletes awaited their answers at once, want more than %d: the limit's pace times the answer is 50", flight.most(), 2*minDeletesInFlight)
	}
}

// TestGCMarksReachLimitWithSlowAnswers: on an API server that answers
// each patch in 250 ms, a collector limited to 200 deletes a second marks
// as many identities in flight as it deletes (200 here), so that it marks
// what its limit lets it delete: far more than gcMarksInFlight marks await
// their answers at once, and 200 marks take about one answer. 8 at a time
// (checked) take 200/8 answers, 6.25 s.
func TestGCMarksReachLimitWithSlowAnswers(t *testing.T) {
	srv := serialServer(t)
	cfg := gcTestConfig
	cfg.RateLimit, cfg.RateInterval = 200, time.Second
	const answer = 250 * time.Millisecond
	slow, flight := slowAnswers(srv.RESTConfig(), answer, func(r *http.Request) bool {
		return r.Method == http.MethodPatch && strings.Contains(r.URL.Path, "/ciliumidentities/")
	})
	a := startGCNode(t, slow, "node-a", cfg)
	const n = 200
	createSpaced(t, a.Store, 55000, n, "slow-mark-limit", nil)
	waitCacheCurrent(t, a.Store)
	start := time.Now()
	res, err := a.collect(t.Context())
	took := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	if res.Marked != n {
		t.Fatalf("run: %+v, want %d marked", res, n)
	}
	t.Logf("%d marks answered in %s each took %s, at most %d in flight", n, answer, took, flight.most())
	if flight.most() <= 4*gcMarksInFlight {
		t.Fatalf("at most %d marks awaited their answers at once, want more than %d", flight.most(), 4*gcMarksInFlight)
	}
}

// TestGCNotBeforeListing: a store whose caches have not listed the objects
// yet does not collect: nothing is marked.
func TestGCNotBeforeListing(t *testing.T) {
	srv := serialServer(t)
	a := startGCNode(t, srv.RESTConfig(), "node-a", gcTestConfig)
	id := identity.NumericIdentity(2000)
	createIdentity(t, a.Store, id, mustLabels(t, "k8s:app=unlisted"), "")
	cold := newGCNode(t, srv.RESTConfig(), "node-cold", gcTestConfig)
	_, err := cold.collect(t.Context())
	if !errors.Is(err, globalstore.ErrUnavailable) {
		t.Fatalf("collect before the listing: %v, want ErrUnavailable", err)
	}
	if _, ok := markOf(t, a.Store, id); ok {
		t.Fatal("a collection before the listing marked an identity")
	}
	if st := cold.gcStats(); st.Runs != 1 || st.Failed != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// TestGCJob: with an interval, the collection runs as the store's timer
// job and frees an unused identity on its own.
func TestGCJob(t *testing.T) {
	srv := serialServer(t)
	cfg := gcTestConfig
	cfg.Interval, cfg.HeartbeatTimeout = 200*time.Millisecond, 300*time.Millisecond
	a := startGCNode(t, srv.RESTConfig(), "node-a", cfg)
	id := identity.NumericIdentity(3000)
	createIdentity(t, a.Store, id, mustLabels(t, "k8s:app=job"), "")
	eventually.True(t, "the job deletes the unused identity", func() bool { return readIdentity(t, a.Store, id) == nil })
	eventually.True(t, "the job counts its deletion", func() bool { return a.gcStats().Deleted == 1 })
	if st := a.gcStats(); st.Marked != 1 || st.Failed != 0 {
		t.Fatalf("stats %+v", st)
	}
}

// TestGCRunsBackToBack: the interval counts from the start of a run, so a
// run whose paced deletes outlast it is followed by the next at once, not
// an interval after its end. The first run deletes 40 identities at 20 a
// second (2 s, twice the interval); 20 more, made due during it, are
// deleted by the next run, whose first delete starts less than half an
// interval after the first run's last.
func TestGCRunsBackToBack(t *testing.T) {
	srv := serialServer(t)
	cfg := gcTestConfig
	cfg.Interval, cfg.RateLimit, cfg.RateInterval = time.Second, 20, time.Second
	n := newGCNode(t, srv.RESTConfig(), "node-a", cfg)
	a := n.Store
	old := oldMark()
	const first, second = 40, 20
	for i := range first {
		// Every other ID, so that no object fences another.
		createIdentity(t, a, identity.NumericIdentity(52000+2*i), mustLabels(t, fmt.Sprintf("k8s:app=back-%d", i)), old)
	}
	var (
		mu    sync.Mutex
		times = map[uint64][]time.Time{}
		added sync.Once
	)
	a.gc.beforeDelete = func(*gcObject) {
		mu.Lock()
		run := a.gc.runs.Load()
		times[run] = append(times[run], time.Now())
		mu.Unlock()
		added.Do(func() {
			go func() {
				for i := range second {
					createIdentity(t, a, identity.NumericIdentity(53000+2*i), mustLabels(t, fmt.Sprintf("k8s:app=back-late-%d", i)), old)
				}
			}()
		})
	}
	n.start(t)
	eventually.True(t, "both runs delete", func() bool { return a.gcStats().Deleted == first+second })
	mu.Lock()
	defer mu.Unlock()
	var runs []uint64
	for r := range times {
		runs = append(runs, r)
	}
	slices.Sort(runs)
	if len(runs) < 2 || len(times[runs[0]]) != first {
		t.Fatalf("deletes by run: %d runs, the first with %d, want %d", len(runs), len(times[runs[0]]), first)
	}
	firstRun := times[runs[0]]
	gap := times[runs[1]][0].Sub(firstRun[len(firstRun)-1])
	t.Logf("the first run's deletes spanned %s; the next run's first delete came %s after its last", firstRun[len(firstRun)-1].Sub(firstRun[0]), gap)
	if gap > cfg.Interval/2 {
		t.Fatalf("the next run's first delete came %s after the first run's last, want under half the %s interval", gap, cfg.Interval)
	}
}

// TestGCDeletesInFlight: the deletes in flight are those the limit starts
// in a second, between 8 and 512 (docs/crd-store.md).
func TestGCDeletesInFlight(t *testing.T) {
	for _, c := range []struct {
		limit    int64
		interval time.Duration
		want     int
	}{
		{2500, time.Minute, 42},
		{3600, time.Minute, 60},
		{7500, time.Minute, 125},
		{60, time.Minute, minDeletesInFlight},
		{1e6, time.Second, maxDeletesInFlight},
	} {
		cfg := GCConfig{RateLimit: c.limit, RateInterval: c.interval}
		if got := cfg.deletesInFlight(); got != c.want {
			t.Errorf("%d per %s: %d deletes in flight, want %d", c.limit, c.interval, got, c.want)
		}
		if got := newGCState(cfg).deletesInFlight; got != c.want {
			t.Errorf("%d per %s: the collector keeps %d in flight, want %d", c.limit, c.interval, got, c.want)
		}
	}
}

func TestGCConfigValidate(t *testing.T) {
	if err := DefaultGCConfig.Validate(); err != nil {
		t.Fatal(err)
	}
	for _, c := range []GCConfig{
		{Interval: -1, RateLimit: 1, RateInterval: 1, HeartbeatTimeout: 1},
		{RateLimit: 0, RateInterval: 1, HeartbeatTimeout: 1},
		{RateLimit: 1, RateInterval: 0, HeartbeatTimeout: 1},
		{RateLimit: 1, RateInterval: 1, HeartbeatTimeout: 0},
		{RateLimit: 1, RateInterval: 1, HeartbeatTimeout: MinHeartbeatTimeout - 1},
	} {
		if c.Validate() == nil {
			t.Errorf("%+v: no error", c)
		}
	}
}

// fencedByWalk is the fence rule computed the slow way, slot by slot.
func fencedByWalk(s *Store, objs []gcObject) map[identity.NumericIdentity]bool {
	held := map[identity.NumericIdentity]bool{}
	for _, o := range objs {
		held[o.id] = true
	}
	out := map[identity.NumericIdentity]bool{}
	for _, o := range objs {
		if o.e == nil {
			continue
		}
		p := idprobe.New(o.e.key, s.cluster)
		k, _ := p.Position(o.id)
		all := true
		for i := uint64(0); i < k; i++ {
			if !held[p.Slot(i)] {
				all = false
				break
			}
		}
		if all {
			for i := uint64(0); i < k; i++ {
				out[p.Slot(i)] = true
			}
		}
	}
	return out
}

// TestGCFenceSweep: the sweep over the range finds what walking each
// young object's probe sequence finds (every object is young here), for runs of held IDs that wrap past the
// range's end, runs with a gap, and objects placed anywhere.
func TestGCFenceSweep(t *testing.T) {
	s := &Store{cluster: gcCluster}
	s.ids = newIdentityCache(hivetest.Logger(t), gcCluster, cacheHooks{})
	lo, hi := gcCluster.MinID(), gcCluster.MaxID()
	object := func(id identity.NumericIdentity, lbls labels.Labels) gcObject {
		obj := CiliumIdentity{ObjectMeta: metav1.ObjectMeta{Name: id.String()}, SecurityLabels: securityLabels(lbls)}
		e, err := s.ids.parse(&obj)
		if err != nil {
			t.Fatal(err)
		}
		return gcObject{id: id, e: e, obj: obj}
	}
	check := func(name string, objs []gcObject) {
		t.Helper()
		slices.SortFunc(objs, func(a, b gcObject) int { return int(a.id) - int(b.id) })
		got, want := fenced(s.ids.rng, objs, time.Time{}), fencedByWalk(s, objs)
		if len(got) != len(want) {
			t.Errorf("%s: %d fenced, want %d", name, len(got), len(want))
		}
		for id := range want {
			if !got[id] {
				t.Errorf("%s: %d not fenced", name, id)
			}
		}
		for id := range got {
			if !want[id] {
				t.Errorf("%s: %d fenced, should not be", name, id)
			}
		}
	}

	// A label set whose sequence starts at most 4 IDs before the range's
	// end and whose object sits at position 5 (wrapped past the end), with
	// positions 0..4 held by others: all five fenced.
	var wrap labels.Labels
	for i := 0; ; i++ {
		l := mustLabels(t, fmt.Sprintf("k8s:app=wrap-%d", i))
		if idprobe.New(l.Canonical(), gcCluster).Slot(0) >= hi-4 {
			wrap = l
			break
		}
		if i > 1<<20 {
			t.Fatal("no label set starts its sequence at the range's end")
		}
	}
	p := idprobe.New(wrap.Canonical(), gcCluster)
	var objs []gcObject
	for i := uint64(0); i < 5; i++ {
		objs = append(objs, object(p.Slot(i), mustLabels(t, fmt.Sprintf("k8s:app=filler-%d", i))))
	}
	objs = append(objs, object(p.Slot(5), wrap))
	if p.Slot(5) >= p.Slot(0) {
		t.Fatalf("slot 5 is %d, slot 0 %d: not wrapped", p.Slot(5), p.Slot(0))
	}
	check("wrapping run", slices.Clone(objs))
	if got := fenced(s.ids.rng, objs, time.Time{}); len(got) < 5 || !got[hi] || !got[p.Slot(0)] {
		t.Fatalf("wrapping run: fenced %v", got)
	}
	// A gap before the object: it is not where the walk finds its label
	// set, and fences nothing.
	gapped := slices.Delete(slices.Clone(objs), 2, 3)
	check("gap", gapped)
	if got := fenced(s.ids.rng, gapped, time.Time{}); got[p.Slot(0)] {
		t.Fatalf("gap: fenced %v", got)
	}
	// Many label sets, each at the first free slot of its sequence in a
	// crowded corner of the range, then some removed: the two ways agree.
	var crowd []gcObject
	held := map[identity.NumericIdentity]bool{}
	for i := 0; len(crowd) < 300; i++ {
		l := mustLabels(t, fmt.Sprintf("k8s:app=crowd-%d", i))
		q := idprobe.New(l.Canonical(), gcCluster)
		if q.Slot(0) < hi-200 && q.Slot(0) > lo+50 {
			continue
		}
		for j := uint64(0); ; j++ {
			if id := q.Slot(j); !held[id] {
				held[id] = true
				crowd = append(crowd, object(id, l))
				break
			}
		}
	}
	check("crowd", slices.Clone(crowd))
	var thinned []gcObject
	for i, o := range crowd {
		if i%7 != 3 {
			thinned = append(thinned, o)
		}
	}
	check("thinned crowd", thinned)
}

// TestGCFullRangeRecovers: a range filled by walks (each label set at
// the first free slot of its sequence, so most objects sit far from their
// sequence's start) and full for a while, a tenth of it released: the
// collection job and the walks that take the slots of identities it would
// delete (reclaim) free every released identity, and the same number of
// new label sets get IDs within two collection intervals plus the heartbeat
// timeout and the window of a step announcement (and the reference write,
// room for a loaded machine, and the time that many allocations took in
// the fill). The range is narrowed to CRDSTORE_FULLRANGE_SIZE IDs (200;
// the store's test-only idRange) so that it fills in seconds, and
// CRDSTORE_FULLRANGE_RELEASED of them (20) are released. With the fence
// of every object the released identities stay fenced and no new set gets
// an ID (checked).
func TestGCFullRangeRecovers(t *testing.T) {
	srv := serialServer(t)
	cfg := gcTestConfig
	cfg.Interval, cfg.HeartbeatTimeout = time.Second, 2*time.Second
	size := testproc.CountFromEnv(t, "CRDSTORE_FULLRANGE_SIZE", 200, 2)
	released := testproc.CountFromEnv(t, "CRDSTORE_FULLRANGE_RELEASED", 20, 1)
	if released > size {
		t.Fatalf("CRDSTORE_FULLRANGE_RELEASED=%d is more than CRDSTORE_FULLRANGE_SIZE=%d", released, size)
	}
	n := newGCNode(t, srv.RESTConfig(), "node-a", cfg)
	lo := gcCluster.MinID() + 1000
	n.ids.rng = idRange{lo: lo, hi: lo + identity.NumericIdentity(size) - 1}
	// A step over a marked slot defers its delete by maxWalkAge; the test
	// shortens it as it shortens the timeout.
	n.gc.stepWindow = time.Second
	n.start(t)

	var ids []identity.NumericIdentity
	fillStart := time.Now()
	for i := range size {
		ids = append(ids, n.allocate(t, mustLabels(t, fmt.Sprintf("k8s:app=fill-%d", i))))
	}
	// What the new sets' allocations take on this machine, walks and
	// creates alone: as long as the same number took in the fill.
	allocations := time.Since(fillStart) * time.Duration(released) / time.Duration(size)
	if _, _, err := n.Allocate(t.Context(), mustLabels(t, "k8s:app=one-too-many"), n.refs.Record); !errors.Is(err, globalstore.ErrSpaceExhausted) {
		t.Fatalf("allocation in the full range: %v, want ErrSpaceExhausted", err)
	}
	// The range has been full for a while: the fill's last objects are
	// older than the fence's window.
	time.Sleep(fenceWindow(cfg) + time.Second)
	for _, id := range ids[:released] {
		n.release(t, id)
	}
	start := time.Now()
	bound := 2*cfg.Interval + cfg.HeartbeatTimeout + n.gc.stepWindow
	// The reference write (coalesced over 500 ms), creationTimestamp's
	// whole second, a loaded machine, and the allocations themselves.
	slack := 12*time.Second + allocations
	got := map[identity.NumericIdentity]bool{}
	for i := 0; len(got) < released; {
		if time.Since(start) > bound+slack+20*time.Second {
			t.Fatalf("%d of %d new label sets got an ID in %s (collection: %+v)", len(got), released, time.Since(start), n.gcStats())
		}
		id, _, err := n.Allocate(t.Context(), mustLabels(t, fmt.Sprintf("k8s:app=new-%d", i)), n.refs.Record)
		switch {
		case errors.Is(err, globalstore.ErrSpaceExhausted):
			time.Sleep(100 * time.Millisecond)
			continue
		case err != nil:
			t.Fatal(err)
		}
		if !n.ids.rng.contains(id) || got[id] {
			t.Fatalf("new label set %d got %d: outside the range or given twice", i, id)
		}
		got[id] = true
		i++
	}
	elapsed := time.Since(start)
	t.Logf("%d of %d released, the same number of new label sets got IDs %s after the release (two intervals, the timeout and the step window: %s; as many allocations took %s in the fill; collection: %+v)", released, size, elapsed, bound, allocations, n.gcStats())
	if elapsed > bound+slack {
		t.Fatalf("the new label sets got IDs %s after the release, want within %s plus %s", elapsed, bound, slack)
	}
	if st := n.gcStats(); st.Deleted+st.Reclaimed < uint64(released) {
		t.Fatalf("collection %+v: fewer than %d deleted or reclaimed", st, released)
	}
}

// TestWalkAnnouncesOldMarksOnly: a walk writes the step annotation only on
// the marked objects it stepped over that a collector could delete before
// the walk's object is in the collector's cache. Over stepNotesInFlight+4
// objects of other label sets marked just now, the allocation sends no
// patch at all (without the age rule, one per object: checked); over as
// many marked ten minutes ago, it annotates each with the time of the walk,
// and the new object goes past them.
func TestWalkAnnouncesOldMarksOnly(t *testing.T) {
	srv := serialServer(t)
	cfg := gcTestConfig
	// The collector does not run; the timeouts are the production floor.
	cfg.Interval, cfg.HeartbeatTimeout = 0, DefaultGCConfig.HeartbeatTimeout
	n := startGCNode(t, srv.RESTConfig(), "node-a", cfg)
	if n.stepNoteAge() <= 0 {
		t.Fatalf("stepNoteAge %s: every step announced", n.stepNoteAge())
	}
	const stepped = stepNotesInFlight + 4
	walk := func(name string, markedAt time.Time) (patches float64) {
		t.Helper()
		lbls := mustLabels(t, "k8s:app="+name)
		p := n.ids.rng.probe(lbls.Canonical())
		var others []identity.NumericIdentity
		for i := range uint64(stepped) {
			id := p.Slot(i)
			createIdentity(t, n.Store, id, mustLabels(t, fmt.Sprintf("k8s:app=%s-other-%d", name, i)), markedAt.UTC().Format(time.RFC3339Nano))
			others = append(others, id)
		}
		waitCacheCurrent(t, n.Store)
		before := serverRequests(t, srv)
		walkStart := time.Now()
		if id := n.allocate(t, lbls); id != p.Slot(stepped) {
			t.Fatalf("%s got %d, want %d, past the %d marked objects", name, id, p.Slot(stepped), stepped)
		}
		after := serverRequests(t, srv)
		if got := after["POST"] - before["POST"]; got != 1 {
			t.Errorf("%s: %v creates, want 1", name, got)
		}
		for _, id := range others {
			obj := readIdentity(t, n.Store, id)
			if obj == nil {
				t.Fatalf("%s: stepped-over identity %d is gone", name, id)
			}
			if _, ok := obj.Annotations[HeartbeatAnnotation]; !ok {
				t.Errorf("%s: the walk removed the mark of %d", name, id)
			}
			note, announced := obj.Annotations[stepAnnotation]
			if young := time.Since(markedAt) < n.stepNoteAge(); announced == young {
				t.Errorf("%s: identity %d marked %s before the walk: step annotation %q", name, id, walkStart.Sub(markedAt).Round(time.Second), note)
			} else if announced {
				if at, err := time.Parse(time.RFC3339Nano, note); err != nil || at.Before(walkStart) || time.Since(at) > time.Minute {
					t.Errorf("%s: identity %d's step annotation %q: %v, want the time of the walk", name, id, note, err)
				}
			}
		}
		return after["PATCH"] - before["PATCH"]
	}
	if got := walk("young", time.Now()); got != 0 {
		t.Errorf("a walk over %d objects marked just now sent %v patches, want none", stepped, got)
	}
	if got := walk("old", time.Now().Add(-10*time.Minute)); got != stepped {
		t.Errorf("a walk over %d objects marked ten minutes ago sent %v patches, want one each", stepped, got)
	}
}

// TestWalkLooksAgainBeforeCreate: a walk's last look before its create
// reads the cache as it is then, not as the walk saw it slot by slot. The
// walk of a label set steps over an old mark at the first slot of its
// sequence and announces the step; the test holds that write at the API
// server while the node's cache changes:
//   - placed: an object of the set that identityd placed further on the
//     sequence reaches the cache, as a lagging node's cache shows another
//     node's object late, after the collector freed a slot that node's walk
//     had stepped over (the fence then keeps that slot only for the lag of
//     a cache). The walk adopts that object; it does not create a second
//     one at the free slot.
//   - marked: the held, unmarked second slot gets an old mark. The walk
//     announces its step over that one too.
//
// Without the last look, the first case leaves the set two objects and the
// second announces nothing on the second slot (checked).
func TestWalkLooksAgainBeforeCreate(t *testing.T) {
	srv := serialServer(t)
	var (
		mu      sync.Mutex
		held    string
		arrived chan struct{}
		release chan struct{}
	)
	// hold makes the next PATCH of the CiliumIdentity of id wait, once it
	// reached the server's client, until the returned function runs.
	hold := func(id identity.NumericIdentity) (<-chan struct{}, func()) {
		mu.Lock()
		defer mu.Unlock()
		held, arrived, release = "/ciliumidentities/"+id.String(), make(chan struct{}), make(chan struct{})
		return arrived, sync.OnceFunc(func() { close(release) })
	}
	rc := rest.CopyConfig(srv.RESTConfig())
	rc.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return roundTripFunc(func(r *http.Request) (*http.Response, error) {
			mu.Lock()
			wait := r.Method == http.MethodPatch && held != "" && strings.HasSuffix(r.URL.Path, held)
			a, rel := arrived, release
			if wait {
				held = ""
			}
			mu.Unlock()
			if wait {
				close(a)
				<-rel
			}
			return rt.RoundTrip(r)
		})
	})
	cfg := gcTestConfig
	// No collector; the production floor of the timeouts, so that only
	// old marks are announced.
	cfg.Interval, cfg.HeartbeatTimeout = 0, DefaultGCConfig.HeartbeatTimeout
	n := startGCNode(t, rc, "node-a", cfg)
	oldMark := time.Now().Add(-10 * time.Minute).UTC().Format(time.RFC3339Nano)

	// walk starts the allocation of lbls, waits until it announces its
	// step over the first slot, runs meanwhile, and returns the ID.
	walk := func(lbls labels.Labels, meanwhile func()) identity.NumericIdentity {
		t.Helper()
		arrived, release := hold(n.ids.rng.probe(lbls.Canonical()).Slot(0))
		defer release()
		type result struct {
			id  identity.NumericIdentity
			err error
		}
		done := make(chan result, 1)
		go func() {
			id, _, err := n.Allocate(t.Context(), lbls, n.refs.Record)
			done <- result{id, err}
		}()
		select {
		case <-arrived:
		case r := <-done:
			t.Fatalf("%s: allocated %d (%v) without announcing its step over the first slot", lbls, r.id, r.err)
		case <-time.After(30 * time.Second):
			t.Fatalf("%s: no step annotation within 30s", lbls)
		}
		meanwhile()
		release()
		r := <-done
		if r.err != nil {
			t.Fatal(r.err)
		}
		return r.id
	}

	t.Run("placed", func(t *testing.T) {
		lbls := mustLabels(t, "k8s:app=recheck-placed")
		p := n.ids.rng.probe(lbls.Canonical())
		createIdentity(t, n.Store, p.Slot(0), mustLabels(t, "k8s:app=recheck-placed-first"), oldMark)
		waitCacheCurrent(t, n.Store)
		got := walk(lbls, func() {
			if err := n.create(t.Context(), p.Slot(2), lbls); err != nil {
				t.Fatal(err)
			}
			eventually.True(t, "the cache shows the placed object", func() bool { return n.ids.get(p.Slot(2)) != nil })
		})
		if got != p.Slot(2) {
			t.Errorf("got %d, want %d, the object placed while the walk was announcing", got, p.Slot(2))
		}
		if obj := readIdentity(t, n.Store, p.Slot(1)); obj != nil {
			t.Errorf("the walk created a second object of %s at %d", lbls, p.Slot(1))
		}
	})

	t.Run("marked", func(t *testing.T) {
		lbls := mustLabels(t, "k8s:app=recheck-marked")
		p := n.ids.rng.probe(lbls.Canonical())
		createIdentity(t, n.Store, p.Slot(0), mustLabels(t, "k8s:app=recheck-marked-first"), oldMark)
		createIdentity(t, n.Store, p.Slot(1), mustLabels(t, "k8s:app=recheck-marked-second"), "")
		waitCacheCurrent(t, n.Store)
		got := walk(lbls, func() {
			patch := fmt.Appendf(nil, `{"metadata":{"annotations":{%q:%q}}}`, HeartbeatAnnotation, oldMark)
			if err := n.ciliumClient.Patch(types.MergePatchType).Resource("ciliumidentities").Name(p.Slot(1).String()).Body(patch).Do(t.Context()).Error(); err != nil {
				t.Fatal(err)
			}
			eventually.True(t, "the cache shows the second slot marked", func() bool {
				e := n.ids.get(p.Slot(1))
				return e != nil && e.marked()
			})
		})
		if got != p.Slot(2) {
			t.Fatalf("got %d, want %d", got, p.Slot(2))
		}
		for _, id := range []identity.NumericIdentity{p.Slot(0), p.Slot(1)} {
			if obj := readIdentity(t, n.Store, id); obj == nil || obj.Annotations[stepAnnotation] == "" {
				t.Errorf("identity %d the walk stepped over carries no step annotation", id)
			}
		}
	})
}

// TestGCFenceYoungOnly: the fence decision on a full range. Only an
// object that may have been created after the run's start minus the
// heartbeat timeout fences the slots before it; an old one, however far
// along a crowded run of held IDs, fences nothing, so the released
// identities of a full range can be collected. With the rule that fenced
// for every object (the youngSince argument ignored) the cases of old
// objects fail (checked).
func TestGCFenceYoungOnly(t *testing.T) {
	rng := idRange{lo: 1000, hi: 1099}
	ids := newIdentityCache(hivetest.Logger(t), gcCluster, cacheHooks{})
	ids.rng = rng
	now := time.Date(2026, 12, 2, 1, 0, 0, 0, time.UTC)
	old, fresh := now.Add(-time.Hour), now.Add(-time.Second)
	object := func(id identity.NumericIdentity, lbls labels.Labels, created time.Time) gcObject {
		obj := CiliumIdentity{
			ObjectMeta:     metav1.ObjectMeta{Name: id.String(), CreationTimestamp: metav1.NewTime(created)},
			SecurityLabels: securityLabels(lbls),
		}
		e, err := ids.parse(&obj)
		if err != nil {
			t.Fatal(err)
		}
		return gcObject{id: id, e: e, obj: obj}
	}
	// The range filled the way the walks fill it: each label set at the
	// first free slot of its sequence.
	var full []gcObject
	held := map[identity.NumericIdentity]bool{}
	var displaced int // index of the object farthest from its sequence's start
	var farthest uint64
	for i := 0; uint64(len(full)) < rng.size(); i++ {
		l := mustLabels(t, fmt.Sprintf("k8s:app=fill-%d", i))
		p := rng.probe(l.Canonical())
		for k := uint64(0); ; k++ {
			if id := p.Slot(k); !held[id] {
				held[id] = true
				if k > farthest {
					farthest, displaced = k, len(full)
				}
				full = append(full, object(id, l, old))
				break
			}
		}
	}
	if farthest < 10 {
		t.Fatalf("the farthest object sits at position %d: the range is not crowded", farthest)
	}
	withAge := func(objs []gcObject, i int, created time.Time) []gcObject {
		out := slices.Clone(objs)
		out[i].obj.CreationTimestamp = metav1.NewTime(created)
		return out
	}
	before := func(objs []gcObject, i int) map[identity.NumericIdentity]bool {
		p := rng.probe(objs[i].e.key)
		k, _ := p.Position(objs[i].id)
		out := map[identity.NumericIdentity]bool{}
		for j := uint64(0); j < k; j++ {
			out[p.Slot(j)] = true
		}
		return out
	}
	var gapped []gcObject
	for _, o := range full {
		if p := rng.probe(full[displaced].e.key); o.id != p.Slot(0) {
			gapped = append(gapped, o)
		}
	}
	gappedIdx := slices.IndexFunc(gapped, func(o gcObject) bool { return o.id == full[displaced].id })
	youngSince := now.Add(-30 * time.Minute)
	for _, c := range []struct {
		name       string
		objs       []gcObject
		youngSince time.Time
		want       map[identity.NumericIdentity]bool
	}{
		{"full range, every object old", full, youngSince, map[identity.NumericIdentity]bool{}},
		{"full range, the farthest object young", withAge(full, displaced, fresh), youngSince, before(full, displaced)},
		{"young object with a free slot before it", withAge(gapped, gappedIdx, fresh), youngSince, map[identity.NumericIdentity]bool{}},
		// creationTimestamp counts whole seconds: an object stamped
		// with youngSince's second may have been created after it.
		{"created in youngSince's second", withAge(full, displaced, youngSince.Truncate(time.Second)), youngSince.Add(900 * time.Millisecond), before(full, displaced)},
		{"created the second before youngSince's", withAge(full, displaced, youngSince.Add(-time.Second)), youngSince, map[identity.NumericIdentity]bool{}},
	} {
		got := fenced(rng, c.objs, c.youngSince)
		if len(got) != len(c.want) {
			t.Errorf("%s: %d fenced, want %d", c.name, len(got), len(c.want))
		}
		for id := range c.want {
			if !got[id] {
				t.Errorf("%s: %d not fenced", c.name, id)
			}
		}
	}
}

// TestGCLeavesForeignObjects: objects outside this cluster's range, and
// objects of the range whose labels do not parse, are never marked or
// deleted.
func TestGCLeavesForeignObjects(t *testing.T) {
	srv := serialServer(t)
	a := startGCNode(t, srv.RESTConfig(), "node-a", gcTestConfig)
	old := time.Now().Add(-time.Hour).UTC().Format(time.RFC3339Nano)
	other := gcCluster.MaxID() + 1 // cluster 1's first ID
	createIdentity(t, a.Store, other, mustLabels(t, "k8s:app=other-cluster"), old)
	createIdentity(t, a.Store, 5, mustLabels(t, "reserved:unknown"), "")
	bad := &CiliumIdentity{
		TypeMeta:       metav1.TypeMeta{APIVersion: CiliumGroup + "/" + CiliumVersion, Kind: "CiliumIdentity"},
		ObjectMeta:     metav1.ObjectMeta{Name: "4000", Annotations: map[string]string{HeartbeatAnnotation: old}},
		SecurityLabels: map[string]string{"no-source": "x"},
	}
	if err := a.ciliumClient.Post().Resource("ciliumidentities").Body(bad).Do(t.Context()).Error(); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if res := runGC(t, a.Store); res != (globalstore.GCResult{}) {
			t.Fatalf("run: %+v, want nothing done", res)
		}
	}
	for _, id := range []identity.NumericIdentity{other, 5, 4000} {
		obj := readIdentity(t, a.Store, id)
		if obj == nil {
			t.Fatalf("identity %d was deleted", id)
		}
		if _, ok := obj.Annotations[HeartbeatAnnotation]; ok != (id != 5) {
			t.Fatalf("identity %d: mark changed: %v", id, obj.Annotations)
		}
	}
}

// TestGCMetrics: the collector describes and reports the series of
// docs/operations.md, with the store's counts.
func TestGCMetrics(t *testing.T) {
	s := &Store{gc: newGCState(DefaultGCConfig)}
	s.gc.runs.Store(3)
	s.gc.failed.Store(1)
	s.gc.marked.Store(4)
	s.gc.deleted.Store(2)
	s.gc.keptFenced.Store(7)
	s.gc.reclaimed.Store(5)
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(newGCCollector(s))
	want := `
# HELP identityd_crd_identity_gc_runs Number of CRD identity garbage collection runs since the agent started, by outcome (a run in progress counts as success)
# TYPE identityd_crd_identity_gc_runs gauge
identityd_crd_identity_gc_runs{outcome="failure"} 1
identityd_crd_identity_gc_runs{outcome="success"} 2
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "identityd_crd_identity_gc_runs"); err != nil {
		t.Fatal(err)
	}
	want = `
# HELP identityd_crd_identity_gc_kept Number of CiliumIdentity objects the last garbage collection run kept, by reason: used (a live IdentityNode lists it, or a CiliumEndpoint or CiliumEndpointSlice names it) or fenced (a later identity's probe sequence needs it)
# TYPE identityd_crd_identity_gc_kept gauge
identityd_crd_identity_gc_kept{reason="fenced"} 7
identityd_crd_identity_gc_kept{reason="used"} 0
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "identityd_crd_identity_gc_kept"); err != nil {
		t.Fatal(err)
	}
	want = `
# HELP identityd_crd_identity_gc_leader 1 while this node holds the cluster's IdentityLease of the garbage collection and collects, else 0
# TYPE identityd_crd_identity_gc_leader gauge
identityd_crd_identity_gc_leader 0
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "identityd_crd_identity_gc_leader"); err != nil {
		t.Fatal(err)
	}
	want = `
# HELP identityd_crd_identity_gc_entries Number of CiliumIdentity objects the garbage collection marked, deleted, skipped (a precondition refused the delete: a use won), unmarked (fenced) or reclaimed (deleted by an allocation to take its ID) since the agent started, by status
# TYPE identityd_crd_identity_gc_entries gauge
identityd_crd_identity_gc_entries{status="deleted"} 2
identityd_crd_identity_gc_entries{status="marked"} 4
identityd_crd_identity_gc_entries{status="reclaimed"} 5
identityd_crd_identity_gc_entries{status="skipped"} 0
identityd_crd_identity_gc_entries{status="unmarked"} 0
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "identityd_crd_identity_gc_entries"); err != nil {
		t.Fatal(err)
	}
	if n, err := testutil.GatherAndCount(reg); err != nil || n != 11 {
		t.Fatalf("%d series (%v), want 11", n, err)
	}
}

// TestGCRemarksUndatedMark: a mark that is not an RFC 3339 time is
// replaced by the run's time, and the identity is deleted a timeout after
// that, not at once.
func TestGCRemarksUndatedMark(t *testing.T) {
	srv := serialServer(t)
	a := startGCNode(t, srv.RESTConfig(), "node-a", gcTestConfig)
	id := identity.NumericIdentity(5000)
	createIdentity(t, a.Store, id, mustLabels(t, "k8s:app=undated"), "yesterday")
	if res := runGC(t, a.Store); res.Marked != 1 || res.Deleted != 0 {
		t.Fatalf("first run: %+v, want the mark replaced", res)
	}
	mark, _ := markOf(t, a.Store, id)
	if _, err := time.Parse(time.RFC3339Nano, mark); err != nil {
		t.Fatalf("mark %q: %v", mark, err)
	}
	passTimeout(gcTestConfig, a.Store)
	if res := runGC(t, a.Store); res.Deleted != 1 {
		t.Fatalf("run after the timeout: %+v, want it deleted", res)
	}
}

// TestGCNodeLease: a record counts until renewTime + its lease, and is
// deleted once a further lease has passed; a record without a lease counts
// as one of the shortest lease.
func TestGCNodeLease(t *testing.T) {
	now := time.Now()
	node := func(renewedAgo time.Duration, lease int32) *IdentityNode {
		return &IdentityNode{Spec: IdentityNodeSpec{RenewTime: metav1.NewMicroTime(now.Add(-renewedAgo)), LeaseDurationSeconds: lease}}
	}
	for _, c := range []struct {
		n          *IdentityNode
		live, gone bool
	}{
		{node(10*time.Second, 30), true, false},
		{node(31*time.Second, 30), false, false},
		{node(61*time.Second, 30), false, true},
		{node(-time.Hour, 30), true, false}, // a writer's clock ahead
		{node(20*time.Second, 0), true, false},
		{node(26*time.Second, 0), false, false},
		{node(51*time.Second, -5), false, true},
	} {
		if live, gone := nodeLive(c.n, now), nodeGone(c.n, now); live != c.live || gone != c.gone {
			t.Errorf("renewed %s ago, lease %ds: live %v gone %v, want %v %v",
				now.Sub(c.n.Spec.RenewTime.Time), c.n.Spec.LeaseDurationSeconds, live, gone, c.live, c.gone)
		}
	}
}

// slowAnswers is rc with every request that match selects answered delay
// later, as by a loaded API server, and the most of those requests that
// awaited their answers at once: unlike a run's time, that count does not
// grow when a loaded machine runs the test slowly.
func slowAnswers(rc *rest.Config, delay time.Duration, match func(*http.Request) bool) (*rest.Config, *inFlight) {
	flight := &inFlight{}
	slow := rest.CopyConfig(rc)
	slow.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return roundTripFunc(func(r *http.Request) (*http.Response, error) {
			if !match(r) {
				return rt.RoundTrip(r)
			}
			flight.begin()
			defer flight.end()
			time.Sleep(delay)
			return rt.RoundTrip(r)
		})
	})
	return slow, flight
}

// inFlight counts requests awaiting their answers, and their most at once.
type inFlight struct {
	mu       sync.Mutex
	now, max int
}

func (f *inFlight) begin() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.now++
	f.max = max(f.max, f.now)
}

func (f *inFlight) end() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.now--
}

func (f *inFlight) most() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.max
}

// createSpaced creates n identities in s, 8 at a time, at every other ID
// from first, so that no object fences another, with the labels
// k8s:app=<prefix>-<i> and, unless mark is nil, the heartbeat mark
// mark(i).
func createSpaced(t *testing.T, s *Store, first identity.NumericIdentity, n int, prefix string, mark func(i int) string) {
	t.Helper()
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for i := range n {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			m := ""
			if mark != nil {
				m = mark(i)
			}
			createIdentity(t, s, first+identity.NumericIdentity(2*i), mustLabels(t, fmt.Sprintf("k8s:app=%s-%d", prefix, i)), m)
		}()
	}
	wg.Wait()
}
