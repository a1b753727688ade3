package crdstore

import (
	"fmt"
	"testing"
	"time"
)

// contended returns a store of node whose creates have raced with those
// of racers nodes in all: it lost enough races to wait, and won one
// create in racers.
func contended(node string, racers int) *Store {
	s := &Store{node: node}
	for i := range 200 {
		if i%racers == 0 {
			s.contention.won(10 * time.Millisecond)
		} else {
			s.contention.lost()
		}
	}
	return s
}

// TestCreateRankOneFirst: nodes that race on the same label sets, each
// knowing only its own outcomes, order their creates: in most races one
// node alone has the lowest rank and creates first while the others wait
// at least one step for its object; each node is first for its share of
// the sets; a node's rank for a set is always the same.
func TestCreateRankOneFirst(t *testing.T) {
	const racers, sets = 3, 1000
	var stores []*Store
	for i := range racers {
		s := contended(fmt.Sprintf("node-%d", i), racers)
		if k := s.contention.racers(); k < 2.5 || k > 3.5 {
			t.Fatalf("node-%d estimates %.2f racers, want about %d", i, k, racers)
		}
		stores = append(stores, s)
	}
	alone := 0
	first := make([]int, racers)
	for i := range sets {
		key := fmt.Sprintf("k8s:app=web-%d;", i)
		delays := make([]time.Duration, racers)
		for j, s := range stores {
			delays[j] = s.createDelay(key)
			if again := s.createDelay(key); again != delays[j] {
				t.Fatalf("%s: node-%d waits %s, then %s", key, j, delays[j], again)
			}
		}
		lowest, count := delays[0], 0
		for _, d := range delays {
			lowest = min(lowest, d)
		}
		for j, d := range delays {
			if d == lowest {
				count++
				first[j]++
			}
		}
		if count == 1 {
			alone++
		}
	}
	// Drawn ranks leave about 56% of 3 racers' sets with one first
	// node; the others' creates go out together, as without ranks.
	if alone < sets/2 {
		t.Errorf("one node alone first in %d of %d races, want most", alone, sets)
	}
	for j, n := range first {
		if n < sets/racers/2 {
			t.Errorf("node-%d is among the first in %d of %d races, want about a third or more", j, n, sets)
		}
	}
	t.Logf("one node first in %d of %d races; first per node %v", alone, sets, first)
}

// TestCreateDelayFollowsContention: no wait while the node wins its
// creates; waits by rank once it keeps losing races, up to the cap; none
// again after enough creates won.
func TestCreateDelayFollowsContention(t *testing.T) {
	s := &Store{node: "node-a"}
	for range 100 {
		s.contention.won(10 * time.Millisecond)
	}
	key := "k8s:app=web-0;"
	if d := s.createDelay(key); d != 0 {
		t.Fatalf("delay %s without lost races", d)
	}
	// Losing two of every three races: about 3 racers.
	s = contended("node-a", 3)
	// A label set of rank 1 for this node.
	key = ""
	for i := 0; key == ""; i++ {
		if k := fmt.Sprintf("k8s:app=web-%d;", i); s.createRank(k, s.contention.racers()) == 1 {
			key = k
		}
	}
	d := s.createDelay(key)
	if d < 10*time.Millisecond || d > maxCreateDelay {
		t.Fatalf("delay %s after lost races, want one rank's step (25ms)", d)
	}
	for range contentionMax {
		s.contention.won(10 * time.Millisecond)
	}
	if d := s.createDelay(key); d != 0 {
		t.Fatalf("delay %s after the races stopped", d)
	}
}

// TestRacersEstimate: the estimate of racing nodes follows the share of
// creates won, within its bounds.
func TestRacersEstimate(t *testing.T) {
	var c contention
	if k := c.racers(); k != 1 {
		t.Fatalf("%v racers before any race, want 1", k)
	}
	for range 1000 {
		c.lost()
	}
	if k := c.racers(); k != maxRacers {
		t.Fatalf("%v racers after losing every race, want the cap %d", k, maxRacers)
	}
	for i := range 400 {
		if i%2 == 0 {
			c.won(time.Millisecond)
		} else {
			c.lost()
		}
	}
	if k := c.racers(); k < 1.7 || k > 2.3 {
		t.Fatalf("%v racers after winning one in two, want about 2", k)
	}
}
