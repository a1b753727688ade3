package idtable

import (
	"math/rand/v2"
	"testing"

	"github.com/identityd/identityd/identity"
)

// TestTableFollowsLiveValues checks that a table keeps nodes for the
// values it holds, not for every counter it ever held: after values came
// and went over the whole counter space, it has the nodes of a table that
// was only given the values still held.
func TestTableFollowsLiveValues(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 5))
	var churned, fresh Table[int]
	v := new(int)
	live := map[identity.NumericIdentity]bool{}
	last := identity.MaxLocalIdentity
	if raceEnabled || testing.Short() {
		last = 1 << 20
	}
	// A few values stay from the start, others stay for a while: the
	// space is walked in order, as the local allocator hands IDs out.
	for c := identity.NumericIdentity(1); c <= last; c++ {
		churned.Set(c, v)
		if c < 100 || r.IntN(100_000) == 0 {
			live[c] = true
			continue
		}
		churned.Set(c, nil)
	}
	for c := range live {
		fresh.Set(c, v)
	}
	if churned.n != len(live) {
		t.Fatalf("n = %d, want %d", churned.n, len(live))
	}
	cm, cl := churned.Nodes()
	fm, fl := fresh.Nodes()
	if cm != fm || cl != fl {
		t.Fatalf("after churn %d middle nodes and %d leaves, a table of the same %d values %d and %d", cm, cl, len(live), fm, fl)
	}
	n := 0
	churned.Each(func(*int) { n++ })
	if n != len(live) {
		t.Fatalf("each visits %d values, want %d", n, len(live))
	}
	for c := range live {
		churned.Set(c, nil)
	}
	if m, l := churned.Nodes(); m != 0 || l != 0 || churned.Len() != 0 {
		t.Fatalf("emptied table keeps %d middle nodes and %d leaves, n = %d", m, l, churned.n)
	}
}

// TestTableFirstFree checks the free-ID search against a scan, over
// full, partly full, empty and absent nodes.
func TestTableFirstFree(t *testing.T) {
	var tab Table[int]
	v := new(int)
	fill := func(from, to identity.NumericIdentity) {
		for c := from; c <= to; c++ {
			tab.Set(c, v)
		}
	}
	fill(1, 3*pagedMidValues+17) // full middle nodes and leaves
	fill(5*pagedMidValues, 5*pagedMidValues+pagedFanout-1)
	tab.Set(2*pagedMidValues+300, nil) // a hole in a full middle node
	tab.Set(5*pagedMidValues+pagedFanout-1, nil)
	r := rand.New(rand.NewPCG(9, 9))
	for range 2_000 {
		tab.Set(identity.NumericIdentity(1+r.IntN(6*pagedMidValues)), nil)
		from := identity.NumericIdentity(1 + r.IntN(6*pagedMidValues))
		to := min(from+identity.NumericIdentity(r.IntN(3*pagedMidValues)), identity.MaxLocalIdentity)
		want, wantOK := identity.NumericIdentity(0), false
		for c := from; c <= to; c++ {
			if tab.Get(c) == nil {
				want, wantOK = c, true
				break
			}
		}
		if got, ok := tab.FirstFree(from, to); got != want || ok != wantOK {
			t.Fatalf("firstFree(%d, %d) = %d %v, want %d %v", from, to, got, ok, want, wantOK)
		}
	}
	if _, ok := tab.FirstFree(1, 17); ok {
		t.Fatal("firstFree found a free ID in a full range")
	}
}
