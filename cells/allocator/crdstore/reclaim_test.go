package crdstore

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/testproc"
	"github.com/identityd/identityd/labels"
)

// TestWalkReclaims: on a range the cache shows full, a walk takes the slot
// of the identity the collector would delete (unused, marked ten minutes
// ago), which the collector, set to run once an hour, has not deleted:
// without reclaiming, the allocation is refused. It takes nothing the
// collector would keep: an identity a live IdentityNode record of another
// node lists, one a walk stepped over just now, and, beside Cilium agents,
// any (their uses are in endpoint objects each walk would have to list).
// An identity marked just now is not due: the allocation is refused at
// once, without listing the IdentityNode records (it did, on a range where
// a refused allocation waits for nothing: checked).
func TestWalkReclaims(t *testing.T) {
	srv := serialServer(t)
	cfg := gcTestConfig
	cfg.Interval = time.Hour
	const size = 8
	marked := time.Now().Add(-10 * time.Minute).UTC().Format(time.RFC3339Nano)
	cases := []struct {
		name         string
		ciliumAgents bool
		// keep, when set, gives the marked identity x what the
		// collector keeps it for.
		keep      func(t *testing.T, n *gcNode, x identity.NumericIdentity)
		reclaimed bool
		// markedNow marks x just now rather than ten minutes ago.
		markedNow bool
	}{
		{name: "unused", reclaimed: true},
		{name: "listed by a live node", keep: func(t *testing.T, n *gcNode, x identity.NumericIdentity) {
			rec := &IdentityNode{
				TypeMeta:   metav1.TypeMeta{APIVersion: IdentityGroup + "/" + IdentityVersion, Kind: "IdentityNode"},
				ObjectMeta: metav1.ObjectMeta{Name: "node-b"},
				Spec: IdentityNodeSpec{Identities: []uint32{uint32(x)}, RenewTime: metav1.NowMicro(),
					LeaseDurationSeconds: int32(MinIdentityNodeLeaseTTL.Seconds())},
			}
			if err := n.nodeClient.Post().Resource("identitynodes").Body(rec).Do(t.Context()).Error(); err != nil {
				t.Fatal(err)
			}
		}},
		{name: "stepped over just now", keep: func(t *testing.T, n *gcNode, x identity.NumericIdentity) {
			patch := fmt.Appendf(nil, `{"metadata":{"annotations":{%q:%q}}}`, stepAnnotation, time.Now().UTC().Format(time.RFC3339Nano))
			if _, err := patchMetadataOnly(t.Context(), n.ciliumClient, "ciliumidentities", x.String(), patch); err != nil {
				t.Fatal(err)
			}
		}},
		{name: "beside Cilium agents", ciliumAgents: true},
		{name: "marked just now", markedNow: true},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := cfg
			if tc.markedNow {
				// A mark not due within reclaimWait, which a walk
				// on a full range would wait for.
				c.HeartbeatTimeout = time.Minute
			}
			n := newGCNode(t, srv.RESTConfig(), "node-a", c)
			n.cfg.IdentityGCCiliumAgents = tc.ciliumAgents
			lo := gcCluster.MinID() + 3000 + identity.NumericIdentity(i*size)
			n.ids.rng = idRange{lo: lo, hi: lo + size - 1}
			lbls := mustLabels(t, "k8s:app=reclaiming-"+tc.name)
			// The marked identity sits half way along the new set's
			// sequence, behind identities of other sets that nobody
			// uses and nobody marked yet (the collector marks first).
			p := n.ids.rng.probe(lbls.Canonical())
			x := p.Slot(size / 2)
			for id := lo; id < lo+size; id++ {
				mark := ""
				if id == x {
					mark = marked
				}
				createIdentity(t, n.Store, id, mustLabels(t, fmt.Sprintf("k8s:app=other-%d", id)), mark)
			}
			if tc.keep != nil {
				tc.keep(t, n, x)
			}
			n.start(t)
			waitCacheCurrent(t, n.Store)
			// Old enough that no object fences the others.
			time.Sleep(fenceWindow(cfg) + time.Second)

			if tc.markedNow {
				// Younger than the grace (a minute here).
				patch := fmt.Appendf(nil, `{"metadata":{"annotations":{%q:%q}}}`, HeartbeatAnnotation, time.Now().UTC().Format(time.RFC3339Nano))
				if _, err := patchMetadataOnly(t.Context(), n.ciliumClient, "ciliumidentities", x.String(), patch); err != nil {
					t.Fatal(err)
				}
				waitCacheCurrent(t, n.Store)
			}
			lists := serverRequestsFor(t, srv, "identitynodes")["LIST"]
			id, _, err := n.Allocate(t.Context(), lbls, n.refs.Record)
			if !tc.reclaimed {
				if !errors.Is(err, globalstore.ErrSpaceExhausted) {
					t.Fatalf("allocation: %d, %v; want %v, the marked identity kept", id, err, globalstore.ErrSpaceExhausted)
				}
				if got := serverRequestsFor(t, srv, "identitynodes")["LIST"] - lists; tc.markedNow && got != 0 {
					t.Errorf("the refusal listed the IdentityNode records %v times, want none: no mark is due", got)
				}
				if obj := readIdentity(t, n.Store, x); obj == nil || obj.Annotations[HeartbeatAnnotation] == "" || !tc.markedNow && obj.Annotations[HeartbeatAnnotation] != marked {
					t.Fatalf("identity %d after the refusal: %+v, want it as it was", x, obj)
				}
				if st := n.gcStats(); st.Reclaimed != 0 {
					t.Fatalf("reclaimed %d, want 0", st.Reclaimed)
				}
				return
			}
			if err != nil || id != x {
				t.Fatalf("allocation: %d, %v; want the marked identity's %d", id, err, x)
			}
			obj := readIdentity(t, n.Store, x)
			if obj == nil || obj.Annotations[HeartbeatAnnotation] != "" {
				t.Fatalf("identity %d after the reclaim: %+v, want the new set's object, unmarked", x, obj)
			}
			if st := n.gcStats(); st.Reclaimed != 1 || st.Runs != 0 {
				t.Fatalf("collection %+v: want 1 reclaimed and no collection run", st)
			}
		})
	}
}

// TestCrowdedWalkWaitsBriefly: on a range 90% held, a walk that would step
// over an identity whose mark is far from its timeout to a free slot
// creates there at once: it waits only for an identity due within
// reclaimWait. Waiting for the mark's whole timeout held allocations for
// minutes (checked: the allocation took half its 20 s).
func TestCrowdedWalkWaitsBriefly(t *testing.T) {
	srv := serialServer(t)
	cfg := gcTestConfig
	cfg.Interval, cfg.HeartbeatTimeout = time.Hour, time.Hour
	const size = 10
	n := newGCNode(t, srv.RESTConfig(), "node-a", cfg)
	n.cfg.IdentityGCCiliumAgents = false
	lo := gcCluster.MinID() + 3500
	n.ids.rng = idRange{lo: lo, hi: lo + size - 1}
	lbls := mustLabels(t, "k8s:app=crowded")
	p := n.ids.rng.probe(lbls.Canonical())
	x, free := p.Slot(0), p.Slot(1)
	for id := lo; id < lo+size; id++ {
		mark := ""
		if id == x {
			mark = time.Now().UTC().Format(time.RFC3339Nano)
		}
		if id != free {
			createIdentity(t, n.Store, id, mustLabels(t, fmt.Sprintf("k8s:app=crowd-%d", id)), mark)
		}
	}
	n.start(t)
	waitCacheCurrent(t, n.Store)

	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	start := time.Now()
	id, _, err := n.Allocate(ctx, lbls, n.refs.Record)
	took := time.Since(start)
	if err != nil || id != free {
		t.Fatalf("allocation: %d, %v; want the free slot %d", id, err, free)
	}
	if took > reclaimWait {
		t.Fatalf("the allocation took %s, want under %s: the marked identity is not due for an hour", took, reclaimWait)
	}
}

// TestFullRangeWalkTakesTheFirstDue: on a full range, a walk whose
// sequence reaches an identity due in eight seconds before one due now
// waits for the first and takes its slot: taking the later one's would
// announce a step over the first and defer its delete by the step window,
// and the walks of a refilling range, each announcing again, kept a full
// range's released identities for minutes (without the wait, or with the
// free-slot walk's 5 s horizon, the allocation got the later slot: checked).
func TestFullRangeWalkTakesTheFirstDue(t *testing.T) {
	const size = 8
	lbls := mustLabels(t, "k8s:app=first-due")
	n, ids := fullRangeWithMarks(t, gcCluster.MinID()+3600, size, lbls, map[uint64]time.Duration{
		1: 8 * time.Second, size / 2: -10 * time.Minute,
	})
	soon, due := ids[1], ids[size/2]

	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	id, _, err := n.Allocate(ctx, lbls, n.refs.Record)
	if err != nil || id != soon {
		t.Fatalf("allocation: %d, %v; want %d, the first identity along the sequence to come due (not %d, due already but further on)", id, err, soon, due)
	}
	if obj := readIdentity(t, n.Store, due); obj == nil || obj.Annotations[stepAnnotation] != "" {
		t.Fatalf("identity %d after the allocation: %+v, want it as it was, without a step annotation", due, obj)
	}
}

// fullRangeTimeout is the grace of fullRangeWithMarks's node.
const fullRangeTimeout = 10 * time.Second

// fullRangeWithMarks starts a node, collecting once an hour with a grace
// of fullRangeTimeout, on a full range of size IDs from lo, whose objects
// are old enough that none fences another; then it marks the objects at
// the positions of dueIn along lbls's probe sequence so that each comes
// due dueIn from now. It returns the node and the IDs at those positions.
func fullRangeWithMarks(t *testing.T, lo identity.NumericIdentity, size int, lbls labels.Labels, dueIn map[uint64]time.Duration) (*gcNode, map[uint64]identity.NumericIdentity) {
	t.Helper()
	srv := serialServer(t)
	cfg := gcTestConfig
	cfg.Interval, cfg.HeartbeatTimeout = time.Hour, fullRangeTimeout
	n := newGCNode(t, srv.RESTConfig(), "node-a", cfg)
	n.cfg.IdentityGCCiliumAgents = false
	n.gc.minGrace = fullRangeTimeout
	n.ids.rng = idRange{lo: lo, hi: lo + identity.NumericIdentity(size) - 1}
	for id := n.ids.rng.lo; id <= n.ids.rng.hi; id++ {
		createIdentity(t, n.Store, id, mustLabels(t, fmt.Sprintf("k8s:app=full-%d", id)), "")
	}
	n.start(t)
	// Old enough that no object fences the others.
	time.Sleep(fenceWindow(cfg) + time.Second)

	p := n.ids.rng.probe(lbls.Canonical())
	ids := map[uint64]identity.NumericIdentity{}
	now := time.Now()
	for pos, in := range dueIn {
		ids[pos] = p.Slot(pos)
		at := now.Add(in - fullRangeTimeout)
		patch := fmt.Appendf(nil, `{"metadata":{"annotations":{%q:%q}}}`, HeartbeatAnnotation, at.UTC().Format(time.RFC3339Nano))
		if _, err := patchMetadataOnly(t.Context(), n.ciliumClient, "ciliumidentities", ids[pos].String(), patch); err != nil {
			t.Fatal(err)
		}
	}
	waitCacheCurrent(t, n.Store)
	return n, ids
}

// TestReclaimingWalksShareTheirListings: walks that reclaim at once on a
// full range share one gathering of the collector's inputs, which lists
// every IdentityNode record, rather than list once each. Sixteen walks
// behind a 50 ms proxy list the records at most half as many times as
// there are walks (without the sharing, at least once per walk: 16 and
// more, checked); each takes one of the due identities.
func TestReclaimingWalksShareTheirListings(t *testing.T) {
	srv := serialServer(t)
	cfg := gcTestConfig
	cfg.Interval = time.Hour
	const size, walks = 32, 16
	host, err := url.Parse(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	slow := srv.RESTConfig()
	slow.Host = "https://" + startDelayProxy(t, host.Host, 50*time.Millisecond)
	n := newGCNode(t, slow, "node-a", cfg)
	n.cfg.IdentityGCCiliumAgents = false
	lo := gcCluster.MinID() + 3700
	n.ids.rng = idRange{lo: lo, hi: lo + size - 1}
	marked := time.Now().Add(-10 * time.Minute).UTC().Format(time.RFC3339Nano)
	for id := lo; id < lo+size; id++ {
		mark := ""
		if (id-lo)%2 == 0 {
			mark = marked
		}
		createIdentity(t, n.Store, id, mustLabels(t, fmt.Sprintf("k8s:app=shared-%d", id)), mark)
	}
	n.start(t)
	waitCacheCurrent(t, n.Store)
	// Old enough that no object fences the others.
	time.Sleep(fenceWindow(cfg) + time.Second)

	lists := serverRequestsFor(t, srv, "identitynodes")["LIST"]
	ids := make([]identity.NumericIdentity, walks)
	errs := make([]error, walks)
	var wg sync.WaitGroup
	for i := range walks {
		wg.Go(func() {
			ids[i], _, errs[i] = n.Allocate(t.Context(), mustLabels(t, fmt.Sprintf("k8s:app=sharing-%d", i)), n.refs.Record)
		})
	}
	wg.Wait()
	got := map[identity.NumericIdentity]bool{}
	for i, err := range errs {
		if err != nil {
			t.Fatalf("allocation %d: %v", i, err)
		}
		if (ids[i]-lo)%2 != 0 || got[ids[i]] {
			t.Fatalf("allocation %d got %d: not a due identity's slot, or given twice", i, ids[i])
		}
		got[ids[i]] = true
	}
	listed := serverRequestsFor(t, srv, "identitynodes")["LIST"] - lists
	t.Logf("%d walks listed the IdentityNode records %v times", walks, listed)
	if listed > walks/2 {
		t.Fatalf("%d walks listed the IdentityNode records %v times, want at most %d", walks, listed, walks/2)
	}
}

// TestFullRangeWalkWaitsForLaterMarks: on a full range, a walk waits
// through the marks of a collection run that come due over more than its
// horizon: the identity second along its sequence comes due in 25 s, the
// first in 40 s, one further on is due now. The walk takes the first one's
// slot once it is due. A cap of 31 s from the first wait ended the wait
// before it and took the second one's slot, announcing a step over the
// first (checked). It waits 40 s, so it runs only in make test-long
// (CRDSTORE_LATER_MARKS=1).
func TestFullRangeWalkWaitsForLaterMarks(t *testing.T) {
	if testproc.CountFromEnv(t, "CRDSTORE_LATER_MARKS", 0, 0) == 0 {
		t.Skip("CRDSTORE_LATER_MARKS=1 runs it (make test-long): it waits 40 s")
	}
	const size = 8
	lbls := mustLabels(t, "k8s:app=later-marks")
	n, ids := fullRangeWithMarks(t, gcCluster.MinID()+3900, size, lbls, map[uint64]time.Duration{
		1: 40 * time.Second, 2: 25 * time.Second, size / 2: -10 * time.Minute,
	})
	first, second, due := ids[1], ids[2], ids[size/2]

	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	id, _, err := n.Allocate(ctx, lbls, n.refs.Record)
	if err != nil || id != first {
		t.Fatalf("allocation: %d, %v; want %d, the first identity along the sequence (not %d or %d, due earlier but further on)", id, err, first, second, due)
	}
}
