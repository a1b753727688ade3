package kvstore

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/hive/cell"

	"github.com/identityd/identityd/cells/health"
)

// TestLeaseLossReportedWhenNoticedTwice: a refused write and the keepalive
// notice the same loss at once. Whichever of them enters first, health
// hears of the loss before the lease's lost channel closes. It used to
// hear nothing when the one that had not forgotten the lease closed the
// channel first, and the kvstore stayed OK without a lease.
func TestLeaseLossReportedWhenNoticedTwice(t *testing.T) {
	p := health.NewProvider()
	c := &Client{log: slog.New(slog.NewTextHandler(io.Discard, nil)), health: p.Root().NewScope("kvstore")}
	c.health.OK("Connected")

	// The first caller to end the keepalive stops there until released:
	// it has forgotten the lease and not reported yet.
	var calls atomic.Int32
	held, release := make(chan struct{}), make(chan struct{})
	l := &nodeLease{id: 0x1234, lost: make(chan struct{})}
	l.cancel = func() {
		if calls.Add(1) == 1 {
			close(held)
			<-release
		}
	}
	c.lease = l

	done := make(chan struct{})
	go func() {
		defer close(done)
		c.leaseLost(l, "keepalive ended")
	}()
	<-held
	c.leaseLost(l, "etcd refused a write with it: lease not found")
	select {
	case <-l.lost:
		t.Fatal("the lease's lost channel closed before its loss was reported")
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	<-done
	select {
	case <-l.lost:
	case <-time.After(10 * time.Second):
		t.Fatal("the lease's lost channel never closed")
	}
	for _, st := range p.All() {
		if st.Name == "kvstore" && st.Level != cell.StatusDegraded {
			t.Errorf("kvstore %s (%q) after its lease was lost", st.Level, st.Message)
		}
	}
	if ch := c.LeaseLost(l.id); ch != l.lost {
		t.Error("LeaseLost of the lease just lost is not its lost channel")
	}
}

// TestProposeConfChangeAgainAfterDrop: a membership change that raft
// dropped never completes; it is proposed again after its attempt's
// deadline and the second proposal goes through. Without the deadline the
// embedded etcd's start waited for the dropped one until the start's own
// deadline.
func TestProposeConfChangeAgainAfterDrop(t *testing.T) {
	var proposals atomic.Int32
	propose := func(ctx context.Context) error {
		if proposals.Add(1) == 1 {
			<-ctx.Done() // dropped: no apply ever answers it
			return ctx.Err()
		}
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	if err := proposeConfChange(ctx, 100*time.Millisecond, propose); err != nil {
		t.Fatalf("after a dropped proposal: %v", err)
	}
	if n := proposals.Load(); n != 2 {
		t.Errorf("%d proposals, want 2", n)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("took %v", d)
	}

	// An error other than the attempt's deadline ends it at once, and so
	// does the caller's deadline.
	refused := errors.New("refused")
	if err := proposeConfChange(ctx, time.Second, func(context.Context) error { return refused }); err != refused {
		t.Errorf("got %v, want %v", err, refused)
	}
	short, cancelShort := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancelShort()
	if err := proposeConfChange(short, 100*time.Millisecond, func(ctx context.Context) error {
		<-ctx.Done()
		return ctx.Err()
	}); err == nil || short.Err() == nil {
		t.Errorf("got %v with the caller's deadline passed: %v", err, short.Err())
	}
}
