package crdstore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
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
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/eventually"
	"github.com/identityd/identityd/internal/idprobe"
	"github.com/identityd/identityd/labels"
)

// gcCluster is the cluster of the collection tests: range 256..65535.
var gcCluster = identity.ClusterInfo{Name: "default", MaxConnectedClusters: 255}

// gcTestConfig collects on demand (the tests call RunGC) and deletes a
// marked identity a second after its mark.
var gcTestConfig = GCConfig{RateLimit: 1000, RateInterval: time.Second, HeartbeatTimeout: time.Second}

type nopEvents struct{}

func (nopEvents) Upsert(identity.NumericIdentity, labels.Labels) {}
func (nopEvents) Delete(identity.NumericIdentity, labels.Labels) {}
func (nopEvents) Synced()                                        {}

// testRefs is the allocator's record of one node's references.
type testRefs struct {
	mu   sync.Mutex
	byID map[identity.NumericIdentity]*globalstore.Reference
}

func newTestRefs() *testRefs {
	return &testRefs{byID: map[identity.NumericIdentity]*globalstore.Reference{}}
}

func (r *testRefs) Each(fn func(*globalstore.Reference)) {
	r.mu.Lock()
	refs := make([]*globalstore.Reference, 0, len(r.byID))
	for _, ref := range r.byID {
		refs = append(refs, ref)
	}
	r.mu.Unlock()
	for _, ref := range refs {
		fn(ref)
	}
}

func (r *testRefs) ByID(id identity.NumericIdentity) *globalstore.Reference {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.byID[id]
}

func (r *testRefs) record(ref *globalstore.Reference) {
	r.mu.Lock()
	r.byID[ref.ID] = ref
	r.mu.Unlock()
}

func (r *testRefs) remove(id identity.NumericIdentity) *globalstore.Reference {
	r.mu.Lock()
	defer r.mu.Unlock()
	ref := r.byID[id]
	delete(r.byID, id)
	return ref
}

// gcNode is one started store, as one identityd node runs it.
type gcNode struct {
	*Store
	refs *testRefs
}

// testJobs returns a job group of a started hive that ends with the test.
func testJobs(t *testing.T) job.Group {
	t.Helper()
	var g job.Group
	h := hive.New(job.Cell, cell.Module("gc-test", "Jobs of a test store",
		cell.Invoke(func(r job.Registry) { g = r.NewGroup(health.OrDetached(nil)) })))
	log := hivetest.Logger(t, hivetest.LogLevel(slog.LevelWarn))
	if err := h.Start(log, t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := h.Stop(log, ctx); err != nil {
			t.Error(err)
		}
	})
	return g
}

// newGCStore returns the store of node on cfg, not started.
func newGCStore(t *testing.T, cfg *rest.Config, node string, gc GCConfig) *Store {
	t.Helper()
	s, err := New(hivetest.Logger(t, hivetest.LogLevel(slog.LevelWarn)), cfg, gcCluster, identity.NodeName(node),
		Config{IdentityNodeLeaseTTL: MinIdentityNodeLeaseTTL}, testJobs(t))
	if err != nil {
		t.Fatal(err)
	}
	// Tests shorten the heartbeat timeout below what Validate allows.
	if err := gc.validateBasic(); err != nil {
		t.Fatal(err)
	}
	s.gc = newGCState(gc)
	return s
}

// startGCNode starts the store of node; the test's end stops it.
func startGCNode(t *testing.T, cfg *rest.Config, node string, gc GCConfig) *gcNode {
	t.Helper()
	n := &gcNode{Store: newGCStore(t, cfg, node, gc), refs: newTestRefs()}
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	if err := n.Start(ctx, nopEvents{}, n.refs); err != nil {
		t.Fatal(err)
	}
	if !n.ids.isSynced() {
		t.Fatal("the store's start returned before its first listing")
	}
	t.Cleanup(func() { n.Stop(context.Background()) })
	return n
}

func (n *gcNode) allocate(t *testing.T, lbls labels.Labels) identity.NumericIdentity {
	t.Helper()
	id, _, err := n.Allocate(t.Context(), lbls, n.refs.record)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func (n *gcNode) release(t *testing.T, id identity.NumericIdentity) {
	t.Helper()
	ref := n.refs.remove(id)
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

func runGC(t *testing.T, s *Store) GCResult {
	t.Helper()
	res, err := s.RunGC(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// waitTimeout waits until a mark made now is older than the heartbeat
// timeout.
func waitTimeout(cfg GCConfig) { time.Sleep(cfg.HeartbeatTimeout + 50*time.Millisecond) }

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
	waitTimeout(gcTestConfig)
	if res := runGC(t, a.Store); res.Deleted != 1 {
		t.Fatalf("run after the timeout: %+v, want one deleted", res)
	}
	if readIdentity(t, a.Store, id) != nil {
		t.Fatal("the identity is still there")
	}
	if st := a.GCStats(); st.Marked != 1 || st.Deleted != 1 || st.Runs != 3 || st.Failed != 0 {
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
		waitTimeout(gcTestConfig)
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
	if err := a.Stop(t.Context()); err != nil {
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
	waitTimeout(gcTestConfig)
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
	waitTimeout(gcTestConfig)

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
	if st := a.GCStats(); st.Skipped != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// TestGCFence: an identity at position 0 of another label set's probe
// sequence, whose identity sits at position 1 because of it, is kept
// while that identity lives, though nobody uses it, and goes once the
// later one is gone. Without the fence rule this test fails (checked).
func TestGCFence(t *testing.T) {
	srv := serialServer(t)
	a := startGCNode(t, srv.RESTConfig(), "node-a", gcTestConfig)
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
	waitListed(t, a.Store, "node-a", id, true)

	for range 2 {
		res := runGC(t, a.Store)
		if res.Marked != 0 || res.KeptFenced != 1 || res.KeptUsed != 1 {
			t.Fatalf("run while later is in use: %+v, want the first slot kept by the fence", res)
		}
		if _, ok := markOf(t, a.Store, first); ok {
			t.Fatal("the fenced identity got the heartbeat mark")
		}
		waitTimeout(gcTestConfig)
	}

	// A mark another collector set on the fenced identity is removed.
	patch := fmt.Appendf(nil, `{"metadata":{"annotations":{%q:%q}}}`, HeartbeatAnnotation, time.Now().Add(-time.Hour).UTC().Format(time.RFC3339Nano))
	if err := a.ciliumClient.Patch(types.MergePatchType).Resource("ciliumidentities").Name(first.String()).Body(patch).Do(t.Context()).Error(); err != nil {
		t.Fatal(err)
	}
	if res := runGC(t, a.Store); res.Deleted != 0 || res.Unmarked != 1 {
		t.Fatalf("run with the fenced identity marked: %+v, want it unmarked and kept", res)
	}
	if _, ok := markOf(t, a.Store, first); ok {
		t.Fatal("the fenced identity's mark stayed")
	}

	a.release(t, id)
	waitListed(t, a.Store, "node-a", id, false)
	// later is marked; first stays fenced while later exists.
	if res := runGC(t, a.Store); res.Marked != 1 || res.KeptFenced != 1 {
		t.Fatalf("run after the release: %+v, want later marked and first kept", res)
	}
	waitTimeout(gcTestConfig)
	if res := runGC(t, a.Store); res.Deleted != 1 || res.KeptFenced != 1 {
		t.Fatalf("run after the timeout: %+v, want later deleted, first kept", res)
	}
	if readIdentity(t, a.Store, id) != nil {
		t.Fatal("later is still there")
	}
	if _, ok := markOf(t, a.Store, first); ok {
		t.Fatal("first was marked in the run that deleted later")
	}
	if res := runGC(t, a.Store); res.Marked != 1 || res.KeptFenced != 0 {
		t.Fatalf("run after later is gone: %+v, want first marked", res)
	}
	waitTimeout(gcTestConfig)
	if res := runGC(t, a.Store); res.Deleted != 1 {
		t.Fatalf("last run: %+v, want first deleted", res)
	}
	if readIdentity(t, a.Store, first) != nil {
		t.Fatal("first is still there")
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

// TestGCNotBeforeListing: a store whose caches have not listed the objects
// yet does not collect: nothing is marked.
func TestGCNotBeforeListing(t *testing.T) {
	srv := serialServer(t)
	a := startGCNode(t, srv.RESTConfig(), "node-a", gcTestConfig)
	id := identity.NumericIdentity(2000)
	createIdentity(t, a.Store, id, mustLabels(t, "k8s:app=unlisted"), "")
	cold := newGCStore(t, srv.RESTConfig(), "node-cold", gcTestConfig)
	_, err := cold.RunGC(t.Context())
	if !errors.Is(err, globalstore.ErrUnavailable) {
		t.Fatalf("RunGC before the listing: %v, want ErrUnavailable", err)
	}
	if _, ok := markOf(t, a.Store, id); ok {
		t.Fatal("a collection before the listing marked an identity")
	}
	if st := cold.GCStats(); st.Runs != 1 || st.Failed != 1 {
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
	eventually.True(t, "the job counts its deletion", func() bool { return a.GCStats().Deleted == 1 })
	if st := a.GCStats(); st.Marked != 1 || st.Failed != 0 {
		t.Fatalf("stats %+v", st)
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
// object's probe sequence finds, for runs of held IDs that wrap past the
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
		got, want := s.fenced(objs), fencedByWalk(s, objs)
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
	if got := s.fenced(objs); len(got) < 5 || !got[hi] || !got[p.Slot(0)] {
		t.Fatalf("wrapping run: fenced %v", got)
	}
	// A gap before the object: it is not where the walk finds its label
	// set, and fences nothing.
	gapped := slices.Delete(slices.Clone(objs), 2, 3)
	check("gap", gapped)
	if got := s.fenced(gapped); got[p.Slot(0)] {
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
		if res := runGC(t, a.Store); res != (GCResult{}) {
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
	if n, err := testutil.GatherAndCount(reg); err != nil || n != 10 {
		t.Fatalf("%d series (%v), want 10", n, err)
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
	waitTimeout(gcTestConfig)
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
