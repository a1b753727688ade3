package crdstore

import (
	"fmt"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestCreateRankOneFirst: for every label set, exactly one of the live
// nodes ranks first, and the nodes agree on the order; an expired record
// takes no rank.
func TestCreateRankOneFirst(t *testing.T) {
	names := []string{"node-a", "node-b", "node-c", "gone"}
	var list []any
	for _, name := range names {
		renewed := time.Now()
		if name == "gone" {
			renewed = renewed.Add(-time.Hour)
		}
		list = append(list, &IdentityNode{ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: IdentityNodeSpec{RenewTime: metav1.NewMicroTime(renewed), LeaseDurationSeconds: 60}})
	}
	stores := map[string]*Store{}
	for _, name := range names[:3] {
		s := &Store{node: name, nodes: newNodeCache()}
		if err := s.nodes.Replace(list, "1"); err != nil {
			t.Fatal(err)
		}
		stores[name] = s
	}
	for i := range 1000 {
		key := fmt.Sprintf("k8s:app=web-%d;", i)
		seen := map[int]string{}
		for name, s := range stores {
			r := s.createRank(key)
			if other, dup := seen[r]; dup {
				t.Fatalf("%s: %s and %s both rank %d", key, name, other, r)
			}
			seen[r] = name
		}
		for r := range 3 {
			if _, ok := seen[r]; !ok {
				t.Fatalf("%s: no node ranks %d: %v", key, r, seen)
			}
		}
	}
}

// TestCreateDelayFollowsContention: no wait while the node wins its
// creates; waits by rank once it keeps losing races; none again after
// enough creates won.
func TestCreateDelayFollowsContention(t *testing.T) {
	var list []any
	for _, name := range []string{"node-a", "node-b"} {
		list = append(list, &IdentityNode{ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: IdentityNodeSpec{RenewTime: metav1.NewMicroTime(time.Now()), LeaseDurationSeconds: 60}})
	}
	s := &Store{node: "node-a", nodes: newNodeCache()}
	if err := s.nodes.Replace(list, "1"); err != nil {
		t.Fatal(err)
	}
	// A label set node-b creates first.
	key := ""
	for i := 0; key == ""; i++ {
		if k := fmt.Sprintf("k8s:app=web-%d;", i); s.createRank(k) == 1 {
			key = k
		}
	}
	for range 100 {
		s.contention.won(10 * time.Millisecond)
	}
	if d := s.createDelay(key); d != 0 {
		t.Fatalf("delay %s without lost races", d)
	}
	for range 3 {
		s.contention.lost()
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
