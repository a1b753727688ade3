package allocator

import (
	"testing"
	"time"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/eventqueue"
)

// TestDrainTakesUnderLock: while something holds the dispatcher's lock (as
// settle, snapshots and Observe's replay do), a queued change stays in the
// queue; the dispatcher's goroutine may not take it and deliver it later.
// A change taken but not yet in the dispatcher's state is one that a
// reader under the lock, finding the queue empty, would miss (a race
// report in TestLocalWrapsAfterChurn, whose settle read the state while the
// dispatcher's goroutine was still writing it).
func TestDrainTakesUnderLock(t *testing.T) {
	a, _, _ := testAllocator(t, 1<<10)
	change := &identity.Identity{ID: identity.NumericIdentity(1 << 20), Labels: cidr("192.0.2.0/24")}
	d := a.disp
	d.mu.Lock()
	locked := true
	defer func() {
		if locked {
			d.mu.Unlock()
		}
	}()
	d.queue.pushEvent(event{kind: ChangeUpsert, ident: change, source: SourceRemote})
	// The dispatcher's goroutine is woken by the push; give it time to
	// take the change if it can, looking at the queue as it does.
	for deadline := time.Now().Add(200 * time.Millisecond); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		chunks := d.queue.q.Take()
		if len(chunks) == 0 {
			if d.state.Get(change.ID) == nil {
				t.Fatal("the queue is empty and the dispatcher's state lacks the change: a drain took it without the lock")
			}
			break
		}
		for _, ev := range eventqueue.All(chunks) {
			d.queue.pushEvent(ev)
		}
		d.queue.q.Recycle(chunks)
	}
	d.mu.Unlock()
	locked = false
	settle(a)
	d.mu.Lock()
	got := d.state.Get(change.ID)
	d.mu.Unlock()
	if got == nil || !got.Labels.Equal(change.Labels) {
		t.Fatalf("after settle the dispatcher's state has %v for the change, want %v", got, change)
	}
}
