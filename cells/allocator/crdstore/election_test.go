package crdstore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/prometheus/client_golang/prometheus"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/retry"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/eventually"
	"github.com/identityd/identityd/internal/k8stest"
)

// testElection are short election timings: the others take a lock whose
// holder stopped renewing within lease + 4.4 × retry = 3.3 s.
var testElection = electionTimings{lease: 2 * time.Second, renewDeadline: 1500 * time.Millisecond, retry: 300 * time.Millisecond}

// wire records the requests of one node, and fails every request once the
// node is cut off: a node killed with SIGKILL sends nothing more, and so
// does not release its lock.
type wire struct {
	cut  atomic.Bool
	mu   sync.Mutex
	sent []string // "METHOD path?query"
}

type wireTransport struct {
	w    *wire
	next http.RoundTripper
}

func (t wireTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if t.w.cut.Load() {
		return nil, errors.New("the node is gone")
	}
	t.w.mu.Lock()
	t.w.sent = append(t.w.sent, r.Method+" "+r.URL.RequestURI())
	t.w.mu.Unlock()
	return t.next.RoundTrip(r)
}

func (w *wire) config(rc *rest.Config) *rest.Config {
	rc = rest.CopyConfig(rc)
	rc.Wrap(func(rt http.RoundTripper) http.RoundTripper { return wireTransport{w: w, next: rt} })
	return rc
}

// requests returns the requests sent so far for identityd.io's resource.
func (w *wire) requests(resource string) []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []string
	for _, r := range w.sent {
		if strings.Contains(r, " /apis/identityd.io/v1/"+resource) {
			out = append(out, r)
		}
	}
	return out
}

// electionNode is a started store with short election timings, its wire
// and its health.
type electionNode struct {
	*gcNode
	name   string
	wire   *wire
	health *health.Provider
}

// startElectionNode starts the store of node, collecting with gc, with
// the election timings el; before, when given, changes the store before
// its start.
func startElectionNode(t *testing.T, rc *rest.Config, node string, gc GCConfig, el electionTimings, before ...func(*Store)) *electionNode {
	t.Helper()
	n := &electionNode{name: node, wire: &wire{}}
	n.gcNode = newGCNode(t, n.wire.config(rc), node, gc, health.Cell, cell.Invoke(func(p *health.Provider) { n.health = p }))
	n.electionTimings = el
	for _, f := range before {
		f(n.Store)
	}
	n.start(t)
	return n
}

// electionHealth is the level and message of the node's election job.
func (n *electionNode) electionHealth() (cell.Level, string) {
	for _, st := range n.health.All() {
		if strings.HasSuffix(st.Name, "job-identity-gc-election") {
			return st.Level, st.Message
		}
	}
	return "", ""
}

// leaderGauge is the node's identityd_crd_identity_gc_leader.
func (n *electionNode) leaderGauge(t *testing.T) float64 {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(newGCCollector(n.Store))
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "identityd_crd_identity_gc_leader" {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatal("no identityd_crd_identity_gc_leader")
	return 0
}

// collector waits until exactly one of ns collects, each of the others
// names it, and the health of each says so; it returns its index.
func collector(t *testing.T, ns []*electionNode, within time.Duration) int {
	t.Helper()
	leader := -1
	require(t, within, func() error {
		leader = -1
		for i, n := range ns {
			holder, self := n.GCLeader()
			level, msg := n.electionHealth()
			switch {
			case self && leader >= 0:
				return fmt.Errorf("%s and %s both collect", ns[leader].name, n.name)
			case self:
				leader = i
				if holder != n.name || msg != "This node collects" {
					return fmt.Errorf("%s collects; it names %q, its health says %s %q", n.name, holder, level, msg)
				}
			}
		}
		if leader < 0 {
			return errors.New("no node collects")
		}
		for _, n := range ns {
			if _, self := n.GCLeader(); self {
				continue
			}
			holder, _ := n.GCLeader()
			level, msg := n.electionHealth()
			if want := "Node " + ns[leader].name + " collects"; holder != ns[leader].name || level != cell.StatusOK || msg != want {
				return fmt.Errorf("%s names %q as the collector, its health says %s %q; want %q", n.name, holder, level, msg, want)
			}
		}
		return nil
	})
	return leader
}

// TestGCOneCollector: of three nodes, one collects (the gauge, GCLeader
// and the election's health agree) and the others do no collection and no
// request to the IdentityNode records of other nodes, at the cost of one
// GET of the lock per retry period. The collector is then cut off and
// stopped, as by SIGKILL (its lock is not released): another node takes
// over within one IdentityNode lease, deletes an identity marked a timeout
// ago, and keeps those that live records list, the killed node's included
// (its lease has not ended).
func TestGCOneCollector(t *testing.T) {
	srv := serialServer(t)
	cfg := gcTestConfig
	cfg.Interval = 100 * time.Millisecond
	began := time.Now()
	var ns []*electionNode
	for _, name := range []string{"node-a", "node-b", "node-c"} {
		ns = append(ns, startElectionNode(t, srv.RESTConfig(), name, cfg, testElection))
	}
	first := collector(t, ns, 10*time.Second)
	old := ns[first]
	var others []*electionNode
	for i, n := range ns {
		if i != first {
			others = append(others, n)
		}
	}
	// Exactly one collects at every moment, for a while.
	for range 10 {
		leaders := 0
		for _, n := range ns {
			g := n.leaderGauge(t)
			if _, self := n.GCLeader(); self != (g == 1) {
				t.Fatalf("%s: gauge %v, GCLeader self %v", n.name, g, self)
			}
			leaders += int(g)
		}
		if leaders != 1 {
			t.Fatalf("%d nodes collect", leaders)
		}
		time.Sleep(50 * time.Millisecond)
	}

	used := others[0].allocate(t, mustLabels(t, "k8s:app=used"))
	waitListed(t, old.Store, others[0].name, used, true)
	killedUses := old.allocate(t, mustLabels(t, "k8s:app=killed-uses"))
	waitListed(t, old.Store, old.name, killedUses, true)
	longAgo := time.Now().Add(-time.Hour).UTC().Format(time.RFC3339Nano)
	gone := identity.NumericIdentity(9000)
	createIdentity(t, old.Store, gone, mustLabels(t, "k8s:app=gone"), longAgo)
	eventually.True(t, "the collector deletes the identity marked long ago", func() bool { return readIdentity(t, old.Store, gone) == nil })
	for _, n := range others {
		if st := n.gcStats(); st.Runs != 0 {
			t.Fatalf("%s does not collect, and ran %d collections", n.name, st.Runs)
		}
	}

	// The collector is cut off, then stopped: it cannot release its lock.
	old.wire.cut.Store(true)
	killed := time.Now()
	require(t, 10*time.Second, func() error {
		// Said, and not a readiness failure (see reportLocked).
		if level, msg := old.electionHealth(); level != cell.StatusOK || !strings.Contains(msg, "IdentityLease identity-gc-0 failed, retrying") {
			return fmt.Errorf("the cut-off collector's election health is %s %q", level, msg)
		}
		return nil
	})
	if err := old.stop(); err != nil {
		t.Fatal(err)
	}
	// `kubectl get lease` names the collector: the Lease, and the
	// IdentityLease that nodes of earlier versions read.
	legacy, lease := testLocks(t, srv.RESTConfig())
	for _, k := range []testLock{lease, legacy} {
		lock, err := k.get(t)
		if err != nil {
			t.Fatal(err)
		}
		if h := lock.Spec.HolderIdentity; h == nil || holderNode(*h) != old.name {
			t.Fatalf("the killed collector's %s names %v, want it still held by %s", k.what, h, old.name)
		}
	}
	next := others[collector(t, others, MinIdentityNodeLeaseTTL)]
	took := time.Since(killed)
	t.Logf("%s collects %s after %s was cut off", next.name, took.Round(10*time.Millisecond), old.name)
	if bound := testElection.lease + 44*testElection.retry/10 + 2*time.Second; took > bound {
		t.Errorf("the takeover took %s, more than lease + 4.4 retry periods (and 2 s for a loaded machine): %s", took, bound)
	}

	gone2 := identity.NumericIdentity(9001)
	createIdentity(t, next.Store, gone2, mustLabels(t, "k8s:app=gone-2"), longAgo)
	eventually.True(t, "the new collector deletes the identity marked long ago", func() bool {
		return readIdentity(t, next.Store, gone2) == nil && next.gcStats().Deleted > 0
	})
	for _, id := range []identity.NumericIdentity{used, killedUses} {
		if readIdentity(t, next.Store, id) == nil {
			t.Errorf("identity %d, listed by a live IdentityNode, was deleted", id)
		}
	}
	for _, n := range others {
		if n != next {
			if st := n.gcStats(); st.Runs != 0 {
				t.Errorf("%s never collected, and ran %d collections", n.name, st.Runs)
			}
		}
	}

	// A node that never collected sent no request for the IdentityNode
	// of another node (no watch, no listing), and read the lock at most
	// once per retry period.
	elapsed := time.Since(began)
	for _, n := range others {
		if n == next {
			continue
		}
		own := "/apis/identityd.io/v1/identitynodes/" + n.name
		ownOnly := url.Values{"fieldSelector": {"metadata.name=" + n.name}}.Encode()
		for _, r := range n.wire.requests("identitynodes") {
			method, uri, _ := strings.Cut(r, " ")
			path, query, _ := strings.Cut(uri, "?")
			// The first write of a missing record is a POST to the
			// collection; the list and watch of the node's own record
			// select it by name.
			collection := path == "/apis/identityd.io/v1/identitynodes"
			ownSelected := method == http.MethodGet && collection && strings.Contains(query, ownOnly)
			if path != own && !ownSelected && (method != http.MethodPost || !collection) {
				t.Errorf("%s, which does not collect, sent %s", n.name, r)
			}
		}
		gets := 0
		for _, r := range n.wire.requests("identityleases") {
			if strings.HasPrefix(r, http.MethodGet+" ") {
				gets++
			}
		}
		if most := int(elapsed/testElection.retry) + 1; gets > most {
			t.Errorf("%s read the lock %d times in %s, more than once per retry period (%d)", n.name, gets, elapsed.Round(time.Millisecond), most)
		}
		t.Logf("%s: %d reads of the lock in %s", n.name, gets, elapsed.Round(time.Millisecond))
	}
}

// handover starts node-a, the collector, and node-b with the timings el
// on srv, calls before once both run, stops node-a and returns how long
// after the stop began node-b collects, waiting at most wait.
func handover(t *testing.T, srv *k8stest.Server, el electionTimings, wait time.Duration, before func(a, b *electionNode)) time.Duration {
	t.Helper()
	cfg := gcTestConfig
	cfg.Interval = time.Hour
	a := startElectionNode(t, srv.RESTConfig(), "node-a", cfg, el)
	collector(t, []*electionNode{a}, 10*time.Second)
	b := startElectionNode(t, srv.RESTConfig(), "node-b", cfg, el)
	collector(t, []*electionNode{a, b}, 10*time.Second)
	before(a, b)
	stopped := time.Now()
	if err := a.stop(); err != nil {
		t.Fatal(err)
	}
	collector(t, []*electionNode{b}, wait)
	took := time.Since(stopped)
	t.Logf("node-b collects %s after node-a's stop began", took.Round(10*time.Millisecond))
	return took
}

// TestGCLeaderHandsOverOnStop: a clean stop (SIGTERM) of the collector
// releases the lock, and another node collects at its next read, within
// 2.2 retry periods (client-go's jitter) rather than a lease. A node
// whose --identity-gc-interval is 0 neither collects nor reads the lock.
func TestGCLeaderHandsOverOnStop(t *testing.T) {
	srv := serialServer(t)
	// A lease far longer than the retry period: without the release,
	// node-b would collect only 3.3 s or more after the stop.
	el := electionTimings{lease: 4 * time.Second, renewDeadline: 3 * time.Second, retry: 300 * time.Millisecond}
	var c *electionNode
	took := handover(t, srv, el, 10*time.Second, func(a, b *electionNode) {
		off := gcTestConfig
		off.Interval = 0
		c = startElectionNode(t, srv.RESTConfig(), "node-c", off, el)
	})
	if bound := 22*el.retry/10 + time.Second; took > bound {
		t.Errorf("node-b collects %s after node-a's stop, want within 2.2 retry periods (and 1 s for a loaded machine): %s", took, bound)
	}
	if holder, self := c.GCLeader(); holder != "" || self {
		t.Errorf("node-c, which does not collect, names %q as the collector (self %v)", holder, self)
	}
	if rs := c.wire.requests("identityleases"); len(rs) > 0 {
		t.Errorf("node-c, which does not collect, sent %d requests for the lock: %v", len(rs), rs)
	}
}

// TestGCLeaderReleasesEditedLock: the lock written behind the holder's
// back (its metadata edited, as kubectl annotate does, or a renewal that
// the stop cancelled after the server applied it) leaves the holder's
// resourceVersion stale; the release at its stop still lands, so another
// node collects within 2.2 retry periods rather than after the lease.
func TestGCLeaderReleasesEditedLock(t *testing.T) {
	srv := serialServer(t)
	// Renewals a second apart: the edit and the stop below land between
	// two of them, so the stop finds the resourceVersion stale.
	el := electionTimings{lease: 8 * time.Second, renewDeadline: 5 * time.Second, retry: time.Second}
	took := handover(t, srv, el, 40*time.Second, func(a, b *electionNode) {
		legacy, lease := testLocks(t, srv.RESTConfig())
		for _, k := range []testLock{legacy, lease} {
			cur, err := k.get(t)
			if err != nil {
				t.Fatal(err)
			}
			cur.Annotations = map[string]string{"example.com/edited": "true"}
			if err := k.write(t, cur, cur.Spec); err != nil {
				t.Fatalf("editing %s: %v", k.what, err)
			}
		}
	})
	if bound := 22*el.retry/10 + 2*time.Second; took > bound {
		t.Errorf("node-b collects %s after node-a's stop, want within 2.2 retry periods (and 2 s for a loaded machine): %s", took, bound)
	}
}

// TestGCCutOffCollectorReplacedWithinALease: a collector that sends
// nothing more (killed, or cut off) is replaced within one lease and 4.4
// retry periods, the documented bound, although the election has two
// locks: a node that takes the first lock from it takes the second at
// once, rather than a lease after it first read that one.
func TestGCCutOffCollectorReplacedWithinALease(t *testing.T) {
	srv := serialServer(t)
	el := electionTimings{lease: 4 * time.Second, renewDeadline: 3 * time.Second, retry: 300 * time.Millisecond}
	took := handover(t, srv, el, 4*el.lease, func(a, b *electionNode) { a.wire.cut.Store(true) })
	if bound := el.lease + 44*el.retry/10 + time.Second; took > bound {
		t.Errorf("the takeover took %s, more than lease + 4.4 retry periods (and 1 s for a loaded machine): %s", took, bound)
	}
}

// TestGCKilledCollectorRestarted: a collector killed with SIGKILL leaves
// the lock held and its IdentityNode in place. When it comes back under
// its node name, it takes the record over from its gone process and the
// lock too, at once, not a lock lease later: meanwhile the cluster would
// have no collector, and the double-write modes no convergence report.
// Another node does not take the lock of the gone agent, which to it is
// the agent of another node.
func TestGCKilledCollectorRestarted(t *testing.T) {
	srv := serialServer(t)
	cli := newClient(t, srv.RESTConfig())
	host, _ := os.Hostname()
	ended := exec.Command("true")
	if err := ended.Run(); err != nil {
		t.Fatal(err)
	}
	now := metav1.NewMicroTime(time.Now())
	record := &IdentityNode{
		TypeMeta:   metav1.TypeMeta{APIVersion: IdentityGroup + "/" + IdentityVersion, Kind: "IdentityNode"},
		ObjectMeta: metav1.ObjectMeta{Name: "node-a"},
		Spec: IdentityNodeSpec{Identities: []uint32{}, RenewTime: now, LeaseDurationSeconds: 600,
			Holder: &globalstore.NodeClaim{Instance: "deadbeef", Host: host, PID: ended.Process.Pid}},
	}
	if err := cli.nodes.Post().Resource("identitynodes").Body(record).Do(t.Context()).Error(); err != nil {
		t.Fatal(err)
	}
	legacy, lease := testLocks(t, srv.RESTConfig())
	for _, k := range []testLock{legacy, lease} {
		if err := k.write(t, nil, heldSpec("node-a"+holderSeparator+"deadbeef", time.Minute, 1)); err != nil {
			t.Fatal(err)
		}
	}

	cfg := gcTestConfig
	cfg.Interval = time.Hour
	// The lock's lease is far longer than the wait below.
	el := electionTimings{lease: time.Minute, renewDeadline: 3 * time.Second, retry: 300 * time.Millisecond}
	b := startElectionNode(t, srv.RESTConfig(), "node-b", cfg, el)
	require(t, 10*time.Second, func() error {
		if h, self := b.GCLeader(); h != "node-a" || self {
			return fmt.Errorf("node-b names %q as the collector (self %v), want the killed node-a", h, self)
		}
		return nil
	})
	a := startElectionNode(t, srv.RESTConfig(), "node-a", cfg, el)
	started := time.Now()
	if got := collector(t, []*electionNode{a, b}, 10*time.Second); got != 0 {
		t.Errorf("node %d collects, want the restarted node-a", got)
	}
	t.Logf("the restarted node-a collects %s after its start", time.Since(started).Round(time.Millisecond))
}

// testLock is one of the election's locks, as an administrator (or a
// node of an earlier version, for the IdentityLease) reads and writes it.
type testLock struct {
	*electionLock
	name string
}

// testLocks returns the locks of the test cluster's election on the API
// server of rc: the IdentityLease and the Lease, in the namespace the
// nodes' default configuration names outside a pod.
func testLocks(tb testing.TB, rc *rest.Config) (legacy, lease testLock) {
	tb.Helper()
	name := fmt.Sprintf("identity-gc-%d", gcCluster.ID)
	locks, err := electionLocks(rc, newClient(tb, rc).nodes, Config{}.leaseNamespace(), name)
	if err != nil {
		tb.Fatal(err)
	}
	return testLock{locks[0], name}, testLock{locks[1], name}
}

func (k testLock) get(tb testing.TB) (*IdentityLease, error) {
	tb.Helper()
	body, err := doRaw(context.Background(), k.request(k.client.Get(), k.name))
	if err != nil {
		return nil, err
	}
	return decodeLock(body, k.electionLock)
}

// write creates the lock with spec (cur nil), or updates cur with it.
func (k testLock) write(tb testing.TB, cur *IdentityLease, spec IdentityLeaseSpec) error {
	tb.Helper()
	obj := &IdentityLease{ObjectMeta: metav1.ObjectMeta{Name: k.name, Namespace: k.namespace}}
	if cur != nil {
		obj = cur.DeepCopy()
	}
	obj.APIVersion, obj.Kind, obj.Spec = k.apiVersion, k.kind, spec
	body, err := json.Marshal(obj)
	if err != nil {
		return err
	}
	if cur == nil {
		return k.request(k.client.Post(), "").Body(body).Do(context.Background()).Error()
	}
	return k.request(k.client.Put(), k.name).Body(body).Do(context.Background()).Error()
}

func (k testLock) delete(tb testing.TB) error {
	tb.Helper()
	return k.request(k.client.Delete(), k.name).Do(context.Background()).Error()
}

// heldSpec is a lock's spec held by holder for lease, renewed now.
func heldSpec(holder string, lease time.Duration, transitions int32) IdentityLeaseSpec {
	now := metav1.NewMicroTime(time.Now())
	dur := int32(lease / time.Second)
	return IdentityLeaseSpec{HolderIdentity: &holder, LeaseDurationSeconds: &dur, AcquireTime: &now, RenewTime: &now, LeaseTransitions: &transitions}
}

// TestLeaseSpecForms: the lock's times are written with microseconds and
// read in any RFC 3339 form, and the election's record survives the
// round trip through the spec.
func TestLeaseSpecForms(t *testing.T) {
	at := time.Date(2026, 12, 2, 1, 2, 3, 456789000, time.UTC)
	rec := lockRecord{holder: "node-1_3f9c", leaseSeconds: 10, acquired: at.Add(-time.Minute), renewed: at, transitions: 2}
	data, err := json.Marshal(leaseSpec(rec))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(data), `"renewTime":"2026-12-02T01:02:03.456789Z"`) {
		t.Errorf("spec %s: renewTime not written with microseconds", data)
	}
	var spec IdentityLeaseSpec
	if err := json.Unmarshal(data, &spec); err != nil {
		t.Fatal(err)
	}
	if got := leaseRecord(&spec); got.holder != rec.holder || got.leaseSeconds != 10 ||
		got.transitions != 2 || !got.renewed.Equal(rec.renewed) || !got.acquired.Equal(rec.acquired) {
		t.Errorf("record after the round trip %+v, want %+v", got, rec)
	}
	for _, form := range []string{"2026-12-02T01:02:03Z", "2026-12-02T01:02:03.456789123Z", "2026-12-02T03:02:03.4+02:00"} {
		var spec IdentityLeaseSpec
		if err := json.Unmarshal(fmt.Appendf(nil, `{"holderIdentity":"x","renewTime":%q}`, form), &spec); err != nil {
			t.Errorf("renewTime %s: %v", form, err)
			continue
		}
		if d := spec.RenewTime.Sub(at); d > time.Second || d < -time.Second {
			t.Errorf("renewTime %s read as %s", form, spec.RenewTime.UTC())
		}
	}
	if holderNode("node-1_3f9c") != "node-1" || holderNode("a_b_3f9c") != "a_b" {
		t.Error("holderNode does not cut the instance off")
	}
}

// TestGCStopsWithLostLock: a collector that finds another holder in the
// lock at its next renewal stops at once, and its run in flight with it:
// the delete the run was about to send is not sent.
func TestGCStopsWithLostLock(t *testing.T) {
	srv := serialServer(t)
	cfg := gcTestConfig
	cfg.Interval = 100 * time.Millisecond
	inDelete := make(chan struct{}, 1)
	a := startElectionNode(t, srv.RESTConfig(), "node-a", cfg, testElection, func(s *Store) {
		s.gc.beforeDelete = func(*gcObject) {
			select {
			case inDelete <- struct{}{}:
			default:
			}
			// Hold the run here until the node's term has ended.
			deadline := time.Now().Add(10 * time.Second)
			for s.election.Load().leading() != nil && time.Now().Before(deadline) {
				time.Sleep(5 * time.Millisecond)
			}
		}
	})
	collector(t, []*electionNode{a}, 10*time.Second)
	id := identity.NumericIdentity(9100)
	createIdentity(t, a.Store, id, mustLabels(t, "k8s:app=doomed"), time.Now().Add(-time.Hour).UTC().Format(time.RFC3339Nano))
	select {
	case <-inDelete:
	case <-time.After(10 * time.Second):
		t.Fatal("the collection did not reach the delete")
	}

	// Another holder takes the lock (an administrator, or a node that
	// judged the lease ended).
	_, lease := testLocks(t, srv.RESTConfig())
	// node-a renews the lock every retry period: a write that meets one
	// of its renewals reads the lock again.
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		lock, err := lease.get(t)
		if err != nil {
			return err
		}
		return lease.write(t, lock, heldSpec("node-x_1", time.Minute, 2))
	}); err != nil {
		t.Fatal(err)
	}
	taken := time.Now()
	require(t, 10*time.Second, func() error {
		if holder, self := a.GCLeader(); self || holder != "node-x" {
			return fmt.Errorf("node-a names %q as the collector (self %v) after node-x took the lock", holder, self)
		}
		return nil
	})
	took := time.Since(taken)
	t.Logf("node-a stopped collecting %s after the lock changed hands", took.Round(time.Millisecond))
	if bound := testElection.retry + time.Second; took > bound {
		t.Errorf("node-a stopped collecting %s after the lock changed hands, want within a renewal (and 1 s for a loaded machine): %s", took, bound)
	}
	eventually.True(t, "the cancelled run ends", func() bool { return a.gcStats().Failed > 0 || a.gcStats().Deleted > 0 })
	time.Sleep(200 * time.Millisecond)
	if readIdentity(t, a.Store, id) == nil || a.gcStats().Deleted != 0 {
		t.Fatalf("the run of a collector whose term ended deleted identity %d (stats %+v)", id, a.gcStats())
	}
	if a.leaderGauge(t) != 0 {
		t.Error("identityd_crd_identity_gc_leader is 1 on a node that lost the lock")
	}
}

// TestGCElectionTimings: for every IdentityNode lease, the timings are
// valid, the lock states its duration in whole seconds, and a
// killed collector is replaced within one IdentityNode lease.
func TestGCElectionTimings(t *testing.T) {
	for _, ttl := range []time.Duration{MinIdentityNodeLeaseTTL, 37 * time.Second, DefaultConfig.IdentityNodeLeaseTTL, 24 * time.Hour} {
		el := gcElectionTimings(ttl)
		if el.lease%time.Second != 0 {
			t.Errorf("ttl %s: lease %s is not whole seconds", ttl, el.lease)
		}
		if err := el.validate(); err != nil {
			t.Errorf("ttl %s: %v", ttl, err)
		}
		if worst := el.lease + 44*el.retry/10; worst > ttl {
			t.Errorf("ttl %s: a killed collector is replaced within %s, more than the lease", ttl, worst)
		}
	}
}

// TestGCLockDeletedOrEdited: the collector's Lease deleted by hand (kubectl
// delete lease) or rewritten without a holder under a running
// cluster of three nodes: within one lock lease (and the others' reads)
// one node collects again, its runs advance, it deletes an identity
// marked long ago, and the gauge and health say so. Before, the holder
// re-created or re-took the lock and kept renewing it without a term: no
// node collected again, and no other node could take the lock.
func TestGCLockDeletedOrEdited(t *testing.T) {
	srv := serialServer(t)
	_, lease := testLocks(t, srv.RESTConfig())
	cfg := gcTestConfig
	cfg.Interval = 100 * time.Millisecond
	// Longer than testElection's: the bound below is a time, and this
	// machine's load must not decide it.
	timings := electionTimings{lease: 5 * time.Second, renewDeadline: 4 * time.Second, retry: 500 * time.Millisecond}
	var ns []*electionNode
	for _, name := range []string{"node-a", "node-b", "node-c"} {
		ns = append(ns, startElectionNode(t, srv.RESTConfig(), name, cfg, timings))
	}
	collector(t, ns, 15*time.Second)
	longAgo := time.Now().Add(-time.Hour).UTC().Format(time.RFC3339Nano)
	// A collector is back within the lock's lease and 4.4 retry periods
	// (the others' jittered reads), with 3 s for a loaded machine.
	bound := timings.lease + 44*timings.retry/10 + 3*time.Second

	tamper := map[string]func() error{
		"deleted": func() error {
			return lease.delete(t)
		},
		"rewritten without a holder": func() error {
			// The holder renews every retry period: a write that meets
			// a renewal reads the lock again.
			return retry.RetryOnConflict(retry.DefaultRetry, func() error {
				lock, err := lease.get(t)
				if err != nil {
					return err
				}
				spec := lock.Spec
				none := ""
				spec.HolderIdentity = &none
				return lease.write(t, lock, spec)
			})
		},
	}
	for i, what := range []string{"deleted", "rewritten without a holder"} {
		if err := tamper[what](); err != nil {
			t.Fatalf("lock %s: %v", what, err)
		}
		tampered := time.Now()
		// The holder notices at its next renewal: look after it.
		time.Sleep(2 * timings.retry)
		next := ns[collector(t, ns, bound)]
		if took := time.Since(tampered); took > bound {
			t.Errorf("lock %s: %s collects %s later, more than %s", what, next.name, took, bound)
		}
		if g := next.leaderGauge(t); g != 1 {
			t.Errorf("lock %s: %s collects, its identityd_crd_identity_gc_leader is %v", what, next.name, g)
		}
		runs := next.gcStats().Runs
		eventually.True(t, "the collector's runs advance", func() bool { return next.gcStats().Runs > runs+1 })
		gone := identity.NumericIdentity(9200 + i)
		createIdentity(t, next.Store, gone, mustLabels(t, fmt.Sprintf("k8s:app=gone-%d", i)), longAgo)
		eventually.True(t, "the collector deletes the identity marked long ago", func() bool {
			return readIdentity(t, next.Store, gone) == nil
		})
		took := time.Since(tampered)
		t.Logf("lock %s: %s collects, and deleted an unused identity, %s later", what, next.name, took.Round(10*time.Millisecond))
		if took > MinIdentityNodeLeaseTTL {
			t.Errorf("lock %s: the unused identity was deleted %s later, more than one IdentityNode lease (%s)", what, took, MinIdentityNodeLeaseTTL)
		}
	}
}

// TestGCUpgradeFromIdentityLease: a cluster upgraded node by node from the
// election on the IdentityLease alone keeps one collector. A node of the
// earlier version (played by the test: it holds the IdentityLease and
// renews it every retry period, as that version does) collects while nodes
// of this version start: none of them collects, and none takes the Lease.
// When it is killed (no release), one of them takes both locks once its
// lease has passed, and renews the IdentityLease as long as it collects,
// so that a node of the earlier version, which reads only that lock,
// finds it held and does not collect. At no moment do two nodes collect.
func TestGCUpgradeFromIdentityLease(t *testing.T) {
	srv := serialServer(t)
	legacy, lease := testLocks(t, srv.RESTConfig())
	cfg := gcTestConfig
	cfg.Interval = time.Hour
	const oldHolder = "node-old" + holderSeparator + "01d"
	if err := legacy.write(t, nil, heldSpec(oldHolder, testElection.lease, 0)); err != nil {
		t.Fatal(err)
	}
	var (
		oldCollects atomic.Bool
		mu          sync.Mutex
		violations  []string
	)
	violation := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		violations = append(violations, fmt.Sprintf(format, args...))
	}
	oldCollects.Store(true)
	kill, killed := make(chan struct{}), make(chan struct{})
	killOld := sync.OnceFunc(func() { close(kill) })
	t.Cleanup(func() { killOld(); <-killed })
	go func() {
		defer close(killed)
		for {
			select {
			case <-kill:
				oldCollects.Store(false)
				return
			case <-time.After(testElection.retry):
			}
			lock, err := legacy.get(t)
			if err != nil {
				continue // a failed renewal is retried, as the old election does
			}
			if h := lock.Spec.HolderIdentity; h == nil || *h != oldHolder {
				violation("the IdentityLease of the live earlier-version collector was taken: holder %v", h)
				oldCollects.Store(false)
				return
			}
			legacy.write(t, lock, heldSpec(oldHolder, testElection.lease, 0))
		}
	}()
	var ns []*electionNode
	stopWatch := make(chan struct{})
	watched := make(chan struct{})
	t.Cleanup(func() { close(stopWatch); <-watched })
	go func() {
		defer close(watched)
		for {
			select {
			case <-stopWatch:
				return
			case <-time.After(20 * time.Millisecond):
			}
			mu.Lock()
			nodes := slices.Clone(ns)
			mu.Unlock()
			var collecting []string
			if oldCollects.Load() {
				collecting = append(collecting, "node-old")
			}
			for _, n := range nodes {
				if _, self := n.GCLeader(); self {
					collecting = append(collecting, n.name)
				}
			}
			if len(collecting) > 1 {
				violation("%v collect at once", collecting)
			}
		}
	}()
	for _, name := range []string{"node-a", "node-b", "node-c"} {
		n := startElectionNode(t, srv.RESTConfig(), name, cfg, testElection)
		mu.Lock()
		ns = append(ns, n)
		mu.Unlock()
	}

	// Three of the old collector's leases: the new nodes read the
	// IdentityLease held, and leave the Lease alone.
	time.Sleep(3 * testElection.lease)
	for _, n := range ns {
		if h, self := n.GCLeader(); self || h != "node-old" {
			t.Errorf("%s names %q as the collector (self %v), want node-old", n.name, h, self)
		}
	}
	if _, err := lease.get(t); !apierrors.IsNotFound(err) {
		t.Errorf("the Lease was written while a node of the earlier version collects: %v", err)
	}

	killOld()
	<-killed
	diedAt := time.Now()
	next := ns[collector(t, ns, testElection.lease+44*testElection.retry/10+5*time.Second)]
	t.Logf("%s collects %s after the earlier-version collector was killed", next.name, time.Since(diedAt).Round(10*time.Millisecond))
	// While it collects, both locks name it, and the IdentityLease stays
	// renewed: an earlier-version node reading it never finds it free.
	deadline := time.Now().Add(3 * testElection.lease)
	for time.Now().Before(deadline) {
		for _, k := range []testLock{lease, legacy} {
			lock, err := k.get(t)
			if err != nil {
				t.Fatalf("%s: %v", k.what, err)
			}
			holder, renewed := "", lock.Spec.RenewTime
			if h := lock.Spec.HolderIdentity; h != nil {
				holder = *h
			}
			if holderNode(holder) != next.name {
				t.Fatalf("%s names %q, want the collector %s", k.what, holder, next.name)
			}
			if renewed == nil || time.Since(renewed.Time) > testElection.lease {
				t.Fatalf("%s was last renewed at %v, more than a lease (%s) ago: an earlier-version node would take it", k.what, renewed, testElection.lease)
			}
		}
		time.Sleep(testElection.retry)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, v := range violations {
		t.Error(v)
	}
}

// TestGCLeaseNamespace: the Lease is in the namespace the flag names, or
// else in the agent pod's (its service account's namespace file), or
// else in kube-system.
func TestGCLeaseNamespace(t *testing.T) {
	file := filepath.Join(t.TempDir(), "namespace")
	defer func(f string) { serviceAccountNamespaceFile = f }(serviceAccountNamespaceFile)
	serviceAccountNamespaceFile = file
	if ns := (Config{}).leaseNamespace(); ns != "kube-system" {
		t.Errorf("outside a pod: %q, want kube-system", ns)
	}
	if err := os.WriteFile(file, []byte("identityd\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if ns := (Config{}).leaseNamespace(); ns != "identityd" {
		t.Errorf("in a pod of namespace identityd: %q", ns)
	}
	if ns := (Config{IdentityGCLeaseNamespace: "ops"}).leaseNamespace(); ns != "ops" {
		t.Errorf("with --identity-gc-lease-namespace=ops: %q", ns)
	}
}
