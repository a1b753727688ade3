package durability

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// TestWait checks that Wait returns the write's error when the write ends
// first, and when ctx ends first returns at once while the write goes on to
// its end.
func TestWait(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		failed := errors.New("disk full")
		if err := Wait(t.Context(), func() error { return failed }); err != failed {
			t.Fatalf("Wait: %v, want the write's error", err)
		}

		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		resume, ended := make(chan struct{}), make(chan struct{})
		err := Wait(ctx, func() error {
			defer close(ended)
			<-resume // a stalled fsync
			return nil
		})
		if !errors.Is(err, ErrWriteNotEnded) || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Wait with a stalled write: %v, want ErrWriteNotEnded and context.DeadlineExceeded", err)
		}
		synctest.Wait()
		select {
		case <-ended:
			t.Fatal("the write ended before the disk answered")
		default:
		}
		close(resume)
		<-ended
	})
}

// TestWithin checks that Within names the bound only when Bound's bound
// ended the context, not when its parent ended first.
func TestWithin(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := Bound(t.Context(), 2*time.Minute)
		defer cancel()
		if w := Within(ctx); w != "" {
			t.Fatalf("Within before the bound: %q", w)
		}
		start := time.Now()
		<-ctx.Done()
		if d := time.Since(start); d != 2*time.Minute {
			t.Fatalf("bound ended after %s, want 2m0s", d)
		}
		if w, want := Within(ctx), " within --identity-allocation-timeout (2m0s)"; w != want {
			t.Fatalf("Within after the bound: %q, want %q", w, want)
		}
		if !errors.Is(ctx.Err(), context.DeadlineExceeded) || !errors.Is(context.Cause(ctx), context.DeadlineExceeded) {
			t.Fatalf("bound ended with %v (cause %v), want a deadline", ctx.Err(), context.Cause(ctx))
		}

		parent, stop := context.WithCancel(t.Context())
		ctx, cancel = Bound(parent, time.Minute)
		defer cancel()
		stop()
		if w := Within(ctx); w != "" {
			t.Fatalf("Within after the parent ended: %q, want none", w)
		}
	})
}
