// Package durability keeps the waits for identityd's durability point
// within their caller's bound. The shell commands that answer at that point
// (identity/allocate, ipcache/upsert) are run by liveness probes and
// operators' scripts, which need an answer within
// --identity-allocation-timeout even when the store of global identities or
// the disk stalls: Bound gives such a command one bound for its allocation
// and its waits together, and Wait lets a caller stop waiting for a write
// that cannot be interrupted (an fsync on a stalled disk) when its bound
// ends.
package durability

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// ErrWriteNotEnded is wrapped, with the context's error, by Wait when the
// context ended before the write.
var ErrWriteNotEnded = errors.New("the write did not end in time")

// Wait runs write in a goroutine of its own and returns its error, or,
// when ctx ends first, an error wrapping ErrWriteNotEnded and ctx's error.
// A write and its fsync cannot be interrupted, and on a stalled disk they
// may take minutes; the caller's wait can be: write goes on to its end
// (holding whatever it holds), its result is dropped, and what it writes
// is on disk once it ends.
func Wait(ctx context.Context, write func() error) error {
	done := make(chan error, 1)
	go func() { done <- write() }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("%w: %w", ErrWriteNotEnded, ctx.Err())
	}
}

// Bound returns ctx bounded by timeout (--identity-allocation-timeout) from
// now, the context of a shell command that allocates and then waits for
// the durability point: the allocator bounds each of its own calls, but
// neither the waits after them (the datapath map, its file, the
// checkpoint) nor the sum, and the command's caller needs one bound for
// all of it. Within tells when the bound ended the command.
func Bound(ctx context.Context, timeout time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeoutCause(ctx, timeout, boundError(timeout))
}

// boundError is the cause of a context that Bound's bound ended; like any
// deadline it wraps context.DeadlineExceeded.
type boundError time.Duration

func (b boundError) Error() string {
	return fmt.Sprintf("--identity-allocation-timeout (%s) passed", time.Duration(b))
}

func (boundError) Unwrap() error { return context.DeadlineExceeded }

// Within is " within --identity-allocation-timeout (2m0s)" when ctx is
// Bound's and its bound has ended it, and "" otherwise: what a command's
// error adds to the state of its change ("not durable", "not all
// applied"), so that the operator tells a store or disk that did not
// answer in time from an allocation or a write that failed.
func Within(ctx context.Context) string {
	var b boundError
	if errors.As(context.Cause(ctx), &b) {
		return fmt.Sprintf(" within --identity-allocation-timeout (%s)", time.Duration(b))
	}
	return ""
}
