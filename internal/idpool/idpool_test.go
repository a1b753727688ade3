package idpool

import (
	"sync"
	"testing"
)

func TestLeaseUseRelease(t *testing.T) {
	p := New(10, 14)
	if p.Size() != 5 || p.Available() != 5 {
		t.Fatalf("size %d available %d", p.Size(), p.Available())
	}
	seen := map[ID]bool{}
	for range 5 {
		id := p.LeaseAvailableID()
		if id < 10 || id > 14 || seen[id] {
			t.Fatalf("leased %d (seen %v)", id, seen)
		}
		seen[id] = true
	}
	if p.LeaseAvailableID() != NoID {
		t.Fatal("leased from an empty pool")
	}
	if !p.Release(12) || p.Release(12) || p.Available() != 1 {
		t.Fatal("release")
	}
	if !p.Use(11) || p.Use(11) {
		t.Fatal("use")
	}
	// A used ID comes back only through Insert.
	if p.Release(11) {
		t.Fatal("released a used ID")
	}
	if !p.Insert(11) || p.Insert(11) || p.Available() != 2 {
		t.Fatal("insert")
	}
	if p.Insert(99) {
		t.Fatal("inserted an ID out of range")
	}
	// Remove takes an available ID and voids a lease.
	if !p.Remove(11) || p.Available() != 1 {
		t.Fatal("remove available")
	}
	if !p.Remove(13) || p.Use(13) || p.Release(13) {
		t.Fatal("a removed lease is still usable")
	}
	if id := p.AllocateID(); id != 12 || p.AllocateID() != NoID {
		t.Fatalf("AllocateID = %d", id)
	}
}

func TestRandomChoice(t *testing.T) {
	// Leases are spread over the range rather than sequential, so nodes
	// allocating at once rarely collide.
	p := New(256, 65535)
	first := p.LeaseAvailableID()
	sequential := true
	for range 20 {
		id := p.LeaseAvailableID()
		if id != first+1 {
			sequential = false
		}
		first = id
	}
	if sequential {
		t.Fatal("leases are sequential")
	}
}

// TestConcurrent: users lease, use, release and insert concurrently; every
// ID ends exactly once in the pool or in a user's hands.
func TestConcurrent(t *testing.T) {
	const workers, rounds = 8, 2000
	p := New(1, 500)
	var mu sync.Mutex
	owned := map[ID]int{}
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mine []ID
			for i := range rounds {
				id := p.LeaseAvailableID()
				if id == NoID {
					if len(mine) > 0 {
						mu.Lock()
						delete(owned, mine[0])
						mu.Unlock()
						p.Insert(mine[0])
						mine = mine[1:]
					}
					continue
				}
				if (i+w)%3 == 0 {
					if !p.Release(id) {
						t.Errorf("release of own lease %d failed", id)
					}
					continue
				}
				if !p.Use(id) {
					t.Errorf("use of own lease %d failed", id)
					continue
				}
				mu.Lock()
				if other, dup := owned[id]; dup {
					t.Errorf("ID %d handed to workers %d and %d", id, other, w)
				}
				owned[id] = w
				mu.Unlock()
				mine = append(mine, id)
				if len(mine) > 40 {
					mu.Lock()
					delete(owned, mine[0])
					mu.Unlock()
					p.Insert(mine[0])
					mine = mine[1:]
				}
			}
		}()
	}
	wg.Wait()
	if got := p.Available() + len(owned); got != 500 {
		t.Fatalf("available %d + owned %d = %d, want 500", p.Available(), len(owned), got)
	}
}
