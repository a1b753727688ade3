// Package storetest checks that a store of global identities keeps the
// contract the allocator relies on (globalstore.Backend), as
// testing/fstest.TestFS checks a file system: a store's tests call Run
// with a Harness that starts the store of one node, and Run starts nodes
// that share the store and checks allocation, adoption, release, races
// between nodes, garbage collection that never deletes what a node uses,
// restarts that keep IDs, and the events a node's cache reports. It owns
// the fakes of what the allocator gives a store: Refs and Events. The
// etcd store's, the CRD store's and internal/allocatortest's tests hold
// the three harnesses (TestConformance).
package storetest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive/cell"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/eventually"
	"github.com/identityd/identityd/labels"
)

// Harness is how Run reaches a store.
type Harness struct {
	// Mode is the store's pure allocation mode
	// (identity.AllocationModeKVStore or identity.AllocationModeCRD):
	// Run binds that mode's Sink of each node.
	Mode identity.AllocationMode
	// Cluster is the ID range the store allocates in.
	Cluster identity.ClusterInfo
	// Start starts the store of the node called name in a hive of its
	// own that includes cells (Run's: they bind the node's Sink, so the
	// hive must provide *globalstore.Sinks), as production starts it,
	// and returns the node's Backend and a function that stops the hive.
	// Every node of one test shares one store; a node started again
	// under the same name after its stop is that node restarted. Run
	// calls stop at most once; the harness stops what is left at the
	// test's end.
	Start func(t *testing.T, name string, cells ...cell.Cell) (b globalstore.Backend, stop func())
	// Collect runs the store's garbage collection once, on the node of
	// b, and fails the test on an error. Run calls it until what it
	// waits for is deleted: a store that marks before it deletes needs
	// several runs.
	Collect func(t *testing.T, b globalstore.Backend)
}

// collectWithin bounds each wait for a collection to delete an identity:
// the CRD store marks in one run and deletes a heartbeat timeout later.
const collectWithin = time.Minute

// Run checks the store of h in subtests that share it.
func Run(t *testing.T, h Harness) {
	t.Run("Allocate", func(t *testing.T) { testAllocate(t, h) })
	t.Run("Adopt", func(t *testing.T) { testAdopt(t, h) })
	t.Run("AdoptOnly", func(t *testing.T) { testAdoptOnly(t, h) })
	t.Run("Race", func(t *testing.T) { testRace(t, h) })
	t.Run("Events", func(t *testing.T) { testEvents(t, h) })
	t.Run("CollectKeepsUsed", func(t *testing.T) { testCollectKeepsUsed(t, h) })
	t.Run("RestartKeepsIDs", func(t *testing.T) { testRestart(t, h) })
}

// node is one started node's store and what Run bound its Sink to.
type node struct {
	name string
	b    globalstore.Backend
	refs *Refs
	ev   *Events
	stop func()
}

func (h Harness) start(t *testing.T, name string) *node {
	t.Helper()
	n := &node{name: name, refs: NewRefs(), ev: NewEvents()}
	bind := cell.Invoke(func(s *globalstore.Sinks) { s.For(h.Mode).Bind(n.ev, n.refs) })
	n.b, n.stop = h.Start(t, name, bind)
	select {
	case <-n.ev.Listed():
	case <-time.After(time.Minute):
		t.Fatalf("node %s: the store reported no complete listing", name)
	}
	return n
}

// nodeName is a node name of the running subtest, valid as an etcd key
// part and a Kubernetes object name.
func nodeName(t *testing.T, suffix string) string {
	sub := t.Name()[strings.LastIndex(t.Name(), "/")+1:]
	return strings.ToLower(sub) + "-" + suffix
}

// set is the i-th label set of the running subtest.
func set(t *testing.T, i int) labels.Labels {
	t.Helper()
	sub := strings.ToLower(t.Name()[strings.LastIndex(t.Name(), "/")+1:])
	l, err := labels.Parse(fmt.Sprintf("k8s:storetest=%s-%d", sub, i))
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(t.Context(), time.Minute)
	t.Cleanup(cancel)
	return c
}

// allocate allocates lbls on n, checks that record was called once with
// the identity returned, and returns it.
func (n *node) allocate(t *testing.T, h Harness, lbls labels.Labels) (identity.NumericIdentity, bool) {
	t.Helper()
	var records int
	var recorded *globalstore.Reference
	id, created, err := n.b.Allocate(ctx(t), lbls, func(r *globalstore.Reference) {
		records++
		recorded = r
		n.refs.Record(r)
	})
	if err != nil {
		t.Fatalf("node %s: allocating %s: %v", n.name, lbls, err)
	}
	if records != 1 || recorded.ID != id || !recorded.Labels.Equal(lbls) {
		t.Fatalf("node %s: allocating %s returned %d but recorded %d reference(s) (last %+v)", n.name, lbls, id, records, recorded)
	}
	if id < h.Cluster.MinID() || id > h.Cluster.MaxID() {
		t.Fatalf("node %s: %s got %d, outside the cluster's range %d-%d", n.name, lbls, id, h.Cluster.MinID(), h.Cluster.MaxID())
	}
	return id, created
}

func (n *node) release(t *testing.T, id identity.NumericIdentity) {
	t.Helper()
	ref := n.refs.Remove(id)
	if ref == nil {
		t.Fatalf("node %s holds no reference to %d", n.name, id)
	}
	if err := n.b.Release(ctx(t), ref); err != nil {
		t.Fatalf("node %s: releasing %d: %v", n.name, id, err)
	}
}

// seesID waits until n's cache gives lbls for id.
func (n *node) seesID(t *testing.T, id identity.NumericIdentity, lbls labels.Labels) {
	t.Helper()
	eventually.Within(t, collectWithin, fmt.Sprintf("node %s looks %d up as %s", n.name, id, lbls), func() bool {
		got, ok := n.b.LookupByID(id)
		byLabels, ok2 := n.b.LookupByLabels(lbls)
		return ok && got.Equal(lbls) && ok2 && byLabels == id
	})
}

// collectUntilGone runs collections on n until its cache no longer holds
// id.
func (h Harness) collectUntilGone(t *testing.T, n *node, id identity.NumericIdentity) {
	t.Helper()
	eventually.Within(t, collectWithin, fmt.Sprintf("a collection on node %s deletes %d", n.name, id), func() bool {
		h.Collect(t, n.b)
		_, ok := n.b.LookupByID(id)
		return !ok
	})
}

// testAllocate: a new label set gets an ID of the range, recorded once and
// in the node's cache; another label set gets another ID.
func testAllocate(t *testing.T, h Harness) {
	a := h.start(t, nodeName(t, "a"))
	id, created := a.allocate(t, h, set(t, 0))
	if !created {
		t.Fatalf("a new label set's identity %d was not created", id)
	}
	a.seesID(t, id, set(t, 0))
	other, _ := a.allocate(t, h, set(t, 1))
	if other == id {
		t.Fatalf("two label sets share the ID %d", id)
	}
	if a.refs.Len() != 2 {
		t.Fatalf("%d references recorded, want 2", a.refs.Len())
	}
}

// testAdopt: a second node gets the first node's ID for the same label
// set, without creating it.
func testAdopt(t *testing.T, h Harness) {
	a := h.start(t, nodeName(t, "a"))
	b := h.start(t, nodeName(t, "b"))
	id, _ := a.allocate(t, h, set(t, 0))
	got, created := b.allocate(t, h, set(t, 0))
	if got != id || created {
		t.Fatalf("node b got %d (created %v) for the label set node a holds as %d, want %d adopted", got, created, id, id)
	}
	b.seesID(t, id, set(t, 0))
}

// testAdoptOnly: Adopt of a label set the store does not hold fails with
// ErrNoIdentity and creates nothing; once another node created it, Adopt
// gives its ID and writes the node's reference, so that collections keep
// it while only the adopting node uses it.
func testAdoptOnly(t *testing.T, h Harness) {
	a := h.start(t, nodeName(t, "a"))
	b := h.start(t, nodeName(t, "b"))
	if id, err := b.b.Adopt(ctx(t), set(t, 0), b.refs.Record); !errors.Is(err, globalstore.ErrNoIdentity) {
		t.Fatalf("Adopt of a label set nobody created: %d, %v, want ErrNoIdentity", id, err)
	}
	if _, ok := b.b.LookupByLabels(set(t, 0)); ok || b.refs.Len() != 0 {
		t.Fatalf("a refused Adopt left an identity or a reference (%d references)", b.refs.Len())
	}
	id, _ := a.allocate(t, h, set(t, 0))
	b.seesID(t, id, set(t, 0))
	var records int
	got, err := b.b.Adopt(ctx(t), set(t, 0), func(r *globalstore.Reference) {
		records++
		b.refs.Record(r)
	})
	if err != nil || got != id || records != 1 {
		t.Fatalf("Adopt after node a created %d: %d, %v, %d records", id, got, err, records)
	}
	a.release(t, id)
	unused, _ := a.allocate(t, h, set(t, 1))
	a.release(t, unused)
	h.collectUntilGone(t, a, unused)
	if l, ok := a.b.LookupByID(id); !ok || !l.Equal(set(t, 0)) {
		t.Fatalf("a collection deleted %d, which node b adopted", id)
	}
	b.release(t, id)
	h.collectUntilGone(t, a, id)
}

// testRace: three nodes allocate the same label sets at once; each set
// gets one ID on every node, and no two sets share one.
func testRace(t *testing.T, h Harness) {
	const sets = 12
	nodes := []*node{h.start(t, nodeName(t, "a")), h.start(t, nodeName(t, "b")), h.start(t, nodeName(t, "c"))}
	ids := make([][]identity.NumericIdentity, len(nodes))
	errs := make(chan error, len(nodes)*sets)
	var wg sync.WaitGroup
	for i, n := range nodes {
		ids[i] = make([]identity.NumericIdentity, sets)
		for s := range sets {
			wg.Go(func() {
				id, _, err := n.b.Allocate(ctx(t), set(t, s), n.refs.Record)
				if err != nil {
					errs <- fmt.Errorf("node %s, set %d: %w", n.name, s, err)
				}
				ids[i][s] = id
			})
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if t.Failed() {
		return
	}
	owner := map[identity.NumericIdentity]int{}
	for s := range sets {
		for i := range nodes {
			if ids[i][s] != ids[0][s] {
				t.Errorf("set %d: node %s got %d, node %s %d", s, nodes[i].name, ids[i][s], nodes[0].name, ids[0][s])
			}
		}
		if o, ok := owner[ids[0][s]]; ok {
			t.Errorf("sets %d and %d share the ID %d", o, s, ids[0][s])
		}
		owner[ids[0][s]] = s
	}
	for _, n := range nodes {
		if n.refs.Len() != sets {
			t.Errorf("node %s recorded %d references, want %d", n.name, n.refs.Len(), sets)
		}
	}
}

// testEvents: a node's first listing reports what exists before it says
// it is complete; later creations and deletions by other nodes reach it.
func testEvents(t *testing.T, h Harness) {
	a := h.start(t, nodeName(t, "a"))
	before, _ := a.allocate(t, h, set(t, 0))
	b := h.start(t, nodeName(t, "b"))
	if got, ok := b.ev.Get(before); !ok || !got.Equal(set(t, 0)) {
		t.Fatalf("node b's first listing did not report %d as %s (got %v, %v)", before, set(t, 0), got, ok)
	}
	after, _ := a.allocate(t, h, set(t, 1))
	eventually.Within(t, collectWithin, "node b is told of the identity node a created after its start", func() bool {
		got, ok := b.ev.Get(after)
		return ok && got.Equal(set(t, 1))
	})
	a.release(t, after)
	h.collectUntilGone(t, a, after)
	eventually.Within(t, collectWithin, "node b is told of the deletion", func() bool {
		_, ok := b.ev.Get(after)
		return !ok && b.ev.Deletes(after) > 0
	})
	if _, ok := b.ev.Get(before); !ok {
		t.Fatalf("node b was told that %d, which node a holds, went", before)
	}
}

// testCollectKeepsUsed: collections that delete what no node uses keep
// what one node still uses after another released it, until it releases
// it too.
func testCollectKeepsUsed(t *testing.T, h Harness) {
	a := h.start(t, nodeName(t, "a"))
	b := h.start(t, nodeName(t, "b"))
	shared, _ := a.allocate(t, h, set(t, 0))
	if got, _ := b.allocate(t, h, set(t, 0)); got != shared {
		t.Fatalf("node b got %d for node a's %d", got, shared)
	}
	// Both caches show it before the collections: a cache that
	// lags is not a deletion.
	a.seesID(t, shared, set(t, 0))
	b.seesID(t, shared, set(t, 0))
	unused, _ := a.allocate(t, h, set(t, 1))
	a.release(t, shared)
	a.release(t, unused)
	// The unused one going shows that the collections went as far as
	// deleting.
	h.collectUntilGone(t, a, unused)
	for _, n := range []*node{a, b} {
		if got, ok := n.b.LookupByID(shared); !ok || !got.Equal(set(t, 0)) {
			t.Fatalf("a collection deleted %d, which node b uses (node %s's cache: %v, %v)", shared, n.name, got, ok)
		}
	}
	b.release(t, shared)
	h.collectUntilGone(t, a, shared)
}

// testRestart: a node that stops and starts again finds the identities
// of the store under their IDs, and gets the same ID for its label set.
func testRestart(t *testing.T, h Harness) {
	name := nodeName(t, "a")
	a := h.start(t, name)
	id, _ := a.allocate(t, h, set(t, 0))
	a.stop()
	again := h.start(t, name)
	if got, ok := again.b.LookupByLabels(set(t, 0)); !ok || got != id {
		t.Fatalf("after the restart the cache gives %d, %v for the label set of %d", got, ok, id)
	}
	if got, created := again.allocate(t, h, set(t, 0)); got != id || created {
		t.Fatalf("after the restart the label set of %d got %d (created %v)", id, got, created)
	}
}
