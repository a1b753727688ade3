package checkpoint

import (
	"context"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/internal/testhive"
)

// unobservedCheckpoint returns a Checkpoint over dir and a running
// allocator, with the journal loaded but without the trigger loop that
// records the allocator's changes: the test delivers them itself, in the
// order it wants.
func unobservedCheckpoint(t *testing.T, dir string) (*Checkpoint, allocator.Allocator) {
	t.Helper()
	var alloc allocator.Allocator
	h := hive.New(
		cell.SimpleHealthCell, job.Cell, statedb.Cell, allocator.Cell,
		cell.Invoke(func(a allocator.Allocator) { alloc = a }),
	)
	testhive.Start(t, h)
	c := &Checkpoint{
		log:   hivetest.Logger(t),
		path:  dir + "/" + FileName,
		alloc: alloc,
		wake:  make(chan struct{}, 1),
		wsem:  make(chan struct{}, 1),
		jwake: make(chan struct{}),
	}
	if _, err := c.Load(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.closeJournal(nil) })
	return c, alloc
}

// TestWaitRecordedWokenByCheckpointWrite: an answer waits for the record
// of its new identity; a checkpoint write takes the identity into the file
// before the allocator's event reaches the journal, and the event then adds
// no record (the file holds it). The write itself must wake the answer:
// nothing else will. This is the interleaving that made ipcache/upsert of
// the restore script wait for its deadline.
func TestWaitRecordedWokenByCheckpointWrite(t *testing.T) {
	c, alloc := unobservedCheckpoint(t, t.TempDir())
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	id, _, err := alloc.Allocate(ctx, cidr("10.77.0.0/16"))
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		seq uint64
		err error
	}
	done := make(chan result, 1)
	go func() {
		wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
		defer wcancel()
		seq, _, err := c.waitRecorded(wctx, id)
		done <- result{seq, err}
	}()
	// The answer finds no record and waits for one.
	time.Sleep(100 * time.Millisecond)
	select {
	case r := <-done:
		t.Fatalf("waitRecorded returned before the identity was recorded: %d, %v", r.seq, r.err)
	default:
	}
	// The write's snapshot holds the identity; then the allocator's event
	// arrives, late.
	if _, err := c.Write(); err != nil {
		t.Fatal(err)
	}
	c.record(allocator.Change{Kind: allocator.ChangeUpsert, ID: id.ID, Labels: id.Labels})
	r := <-done
	if r.err != nil {
		t.Fatalf("the answer was not woken by the checkpoint write that made its identity durable: %v", r.err)
	}
	if r.seq != 0 {
		t.Fatalf("recorded by journal record %d, want 0 (the checkpoint file)", r.seq)
	}
}
