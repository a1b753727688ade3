package crdstore

import (
	"context"
	"fmt"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/identityd/identityd/identity"
)

// TestWalksOfOneNodeDoNotRace: walks of one node that reach the same free
// slot at the end of a run of held slots, as near a full range, wait for
// each other's create instead of sending their own: eight concurrent new
// label sets cost eight creates, behind a 50 ms proxy so that they overlap
// (without pendingSlots, 36 creates in one run, most refused with
// AlreadyExists: checked).
func TestWalksOfOneNodeDoNotRace(t *testing.T) {
	srv := serialServer(t)
	const size, held, walks = 40, 32, 8
	host, err := url.Parse(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	slow := srv.RESTConfig()
	slow.Host = "https://" + startDelayProxy(t, host.Host, 50*time.Millisecond)
	n := newGCNode(t, slow, "node-a", gcTestConfig)
	lo := gcCluster.MinID() + 3800
	n.ids.rng = idRange{lo: lo, hi: lo + size - 1}
	for id := lo; id < lo+held; id++ {
		createIdentity(t, n.Store, id, mustLabels(t, fmt.Sprintf("k8s:app=run-%d", id)), "")
	}
	// Label sets whose sequences start in the run: each walks to its end.
	var sets []string
	for i := 0; len(sets) < walks; i++ {
		key := fmt.Sprintf("k8s:app=racing-%d", i)
		if first := n.ids.rng.probe(mustLabels(t, key).Canonical()).Slot(0); first < lo+held {
			sets = append(sets, key)
		}
	}
	n.start(t)
	waitCacheCurrent(t, n.Store)

	before := serverRequestsFor(t, srv, "ciliumidentities")["POST"]
	ids := make([]identity.NumericIdentity, walks)
	errs := make([]error, walks)
	var wg sync.WaitGroup
	for i, key := range sets {
		wg.Go(func() {
			ids[i], _, errs[i] = n.Allocate(t.Context(), mustLabels(t, key), n.refs.Record)
		})
	}
	wg.Wait()
	got := map[identity.NumericIdentity]bool{}
	for i, err := range errs {
		if err != nil {
			t.Fatalf("allocation of %s: %v", sets[i], err)
		}
		if ids[i] < lo+held || ids[i] > lo+size-1 || got[ids[i]] {
			t.Fatalf("%s got %d: not a free slot after the run, or given twice", sets[i], ids[i])
		}
		got[ids[i]] = true
	}
	creates := serverRequestsFor(t, srv, "ciliumidentities")["POST"] - before
	t.Logf("%d new label sets, %v creates", walks, creates)
	if creates != walks {
		t.Fatalf("%d new label sets sent %v creates, want one each", walks, creates)
	}
}

// TestPendingSlots: a claim in flight makes the next claimer wait; a
// create that left the slot held is another label set's for the walks of
// other sets only, and for pendingHold; a failed one is claimed anew.
func TestPendingSlots(t *testing.T) {
	var ps pendingSlots
	const id = identity.NumericIdentity(1000)
	now := time.Now()
	first, mine := ps.claim(id, "a", now)
	if !mine {
		t.Fatal("first claim: not mine")
	}
	if _, mine := ps.claim(id, "b", now); mine {
		t.Fatal("claim while another is in flight: mine")
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Millisecond)
	defer cancel()
	if _, err := ps.heldByOther(ctx, id, "b"); err == nil {
		t.Fatal("wait for a create in flight: no error at the context's end")
	}

	ps.finish(first, true)
	for _, tc := range []struct {
		key  string
		want bool
	}{{"b", true}, {"a", false}} {
		got, err := ps.heldByOther(t.Context(), id, tc.key)
		if err != nil || got != tc.want {
			t.Fatalf("heldByOther for %q after a create: %v, %v; want %v", tc.key, got, err, tc.want)
		}
	}
	if _, mine := ps.claim(id, "b", time.Now()); mine {
		t.Fatal("claim of a slot just created: mine")
	}
	if _, mine := ps.claim(id, "b", time.Now().Add(pendingHold)); !mine {
		t.Fatal("claim once the create's outcome no longer stands: not mine")
	}

	const other = id + 1
	failed, _ := ps.claim(other, "a", time.Now())
	ps.finish(failed, false)
	if got, _ := ps.heldByOther(t.Context(), other, "b"); got {
		t.Fatal("heldByOther after a failed create: true")
	}
	if _, mine := ps.claim(other, "b", time.Now()); !mine {
		t.Fatal("claim after a failed create: not mine")
	}
}
