package kvstore

import (
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
