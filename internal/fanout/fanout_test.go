package fanout

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/identityd/identityd/internal/eventually"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// recorder is one subscriber's view: what next got, and how it completed.
type recorder struct {
	mu   sync.Mutex
	got  []int
	err  error
	done chan struct{}
}

func subscribe(ctx context.Context, f *Fanout[int], replay []int) *recorder {
	r := &recorder{done: make(chan struct{})}
	f.Subscribe(ctx, replay,
		func(v int) {
			r.mu.Lock()
			r.got = append(r.got, v)
			r.mu.Unlock()
		},
		func(err error) {
			r.err = err
			close(r.done)
		})
	return r
}

func (r *recorder) values() []int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.got)
}

func (r *recorder) wait(t *testing.T) error {
	t.Helper()
	select {
	case <-r.done:
		return r.err
	case <-time.After(eventually.DefaultTimeout):
		t.Fatal("the subscription did not complete")
		return nil
	}
}

// TestFanoutOrder checks that every subscriber gets its replay, then what
// is published, in order, and completes with nil once the Fanout closes.
func TestFanoutOrder(t *testing.T) {
	var f Fanout[int]
	a := subscribe(t.Context(), &f, []int{1, 2})
	f.Publish([]int{3, 4})
	b := subscribe(t.Context(), &f, []int{1, 2, 3, 4})
	if f.Len() != 2 {
		t.Fatalf("Len = %d, want 2", f.Len())
	}
	f.Publish(nil)
	f.Publish([]int{5})
	f.Close()
	for name, r := range map[string]*recorder{"a": a, "b": b} {
		if err := r.wait(t); err != nil {
			t.Fatalf("%s completed with %v, want nil", name, err)
		}
		if got, want := r.values(), []int{1, 2, 3, 4, 5}; !slices.Equal(got, want) {
			t.Fatalf("%s got %v, want %v", name, got, want)
		}
	}
	eventually.True(t, "subscribers gone", func() bool { return f.Len() == 0 })
	// After Close a subscriber gets its replay, then completes.
	late := subscribe(t.Context(), &f, []int{9})
	if err := late.wait(t); err != nil || !slices.Equal(late.values(), []int{9}) {
		t.Fatalf("after Close: got %v, %v; want [9], nil", late.values(), err)
	}
}

// TestFanoutSlowSubscriber checks that a subscriber blocked in next holds
// up neither the publisher nor the other subscribers, and that ending its
// context completes it with the context's error.
func TestFanoutSlowSubscriber(t *testing.T) {
	var f Fanout[int]
	block := make(chan struct{})
	ctx, cancel := context.WithCancel(t.Context())
	slowDone := make(chan error, 1)
	f.Subscribe(ctx, nil, func(int) { <-block }, func(err error) { slowDone <- err })
	fast := subscribe(t.Context(), &f, nil)
	const n = 10_000
	for i := range n {
		f.Publish([]int{i})
	}
	eventually.True(t, "the fast subscriber has everything", func() bool { return len(fast.values()) == n })
	cancel()
	close(block)
	select {
	case err := <-slowDone:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("the slow subscriber completed with %v, want context.Canceled", err)
		}
	case <-time.After(eventually.DefaultTimeout):
		t.Fatal("the slow subscriber did not complete after its context ended")
	}
	eventually.True(t, "the slow subscriber gone", func() bool { return f.Len() == 1 })
	f.Close()
	if err := fast.wait(t); err != nil {
		t.Fatal(err)
	}
}
