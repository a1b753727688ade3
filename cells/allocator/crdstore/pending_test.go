package crdstore

import (
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
	n := &gcNode{Store: newGCStore(t, slow, "node-a", gcTestConfig), refs: newTestRefs()}
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
	if err := n.Start(t.Context(), nopEvents{}, n.refs); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.Stop(t.Context()) })
	waitCacheCurrent(t, n.Store)

	before := serverRequestsFor(t, srv, "ciliumidentities")["POST"]
	ids := make([]identity.NumericIdentity, walks)
	errs := make([]error, walks)
	var wg sync.WaitGroup
	for i, key := range sets {
		wg.Go(func() {
			ids[i], _, errs[i] = n.Allocate(t.Context(), mustLabels(t, key), n.refs.record)
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
