package allocator_test

import (
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/testhive"
	"github.com/identityd/identityd/labels"
)

// lookupHandler is a handler that needs the Allocator itself, as one that
// resolves an added identity's labels through it would.
type lookupHandler struct {
	alloc allocator.Allocator

	mu   sync.Mutex
	seen map[identity.NumericIdentity]bool
}

func (h *lookupHandler) UpdateIdentities(added, _ allocator.IdentityMap) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for id := range added {
		h.seen[id] = h.alloc.LookupByID(id) != nil
	}
}

// TestHandlerMayDependOnAllocator composes a cell whose handler's
// constructor takes the Allocator: no dependency cycle, and the handler
// sees the reserved identities and what is allocated at start.
func TestHandlerMayDependOnAllocator(t *testing.T) {
	var h *lookupHandler
	var a allocator.Allocator
	hv := hive.New(job.Cell, statedb.Cell, allocator.Cell,
		cell.Provide(func(alloc allocator.Allocator) allocator.HandlerOut {
			h = &lookupHandler{alloc: alloc, seen: map[identity.NumericIdentity]bool{}}
			return allocator.NewHandler(h)
		}),
		cell.Invoke(func(x allocator.Allocator) { a = x }),
	)
	testhive.Start(t, hv)
	id, _, err := a.Allocate(t.Context(), labels.MustParse("cidr:10.0.0.0/8", "reserved:world"))
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		h.mu.Lock()
		got, world := h.seen[id.ID], h.seen[identity.ReservedIdentityWorld]
		h.mu.Unlock()
		if got && world {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("handler saw %d: %v, world: %v", id.ID, got, world)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
