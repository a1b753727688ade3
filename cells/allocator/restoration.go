package allocator

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"strings"
	"sync/atomic"
	"time"

	"github.com/cilium/hive/cell"

	"github.com/identityd/identityd/identity"
)

// Restoration is the work that gives the local identities of the previous
// run their old numbers (the restoration cell's Restorer). Until it has
// finished, local allocations that are not restoration's own wait for it:
// an identity allocated before could take a number restoration is about
// to give back. Without a Restoration in the hive nothing waits.
type Restoration interface {
	// Done is closed once restoration has finished, whether it restored
	// everything or not; a Restoration that never closes it keeps local
	// allocations waiting until their bound.
	Done() <-chan struct{}
}

// RestorationStarter is a Restoration that tells when its start hook
// began. A local allocation still waiting a second after it asked, for a
// restoration whose start hook has not begun, is most likely made from a
// start hook that runs before restoration's and so keeps it from running:
// the allocator logs that, naming the caller and the fix, instead of
// waiting silently for --identity-allocation-timeout.
type RestorationStarter interface {
	Restoration
	// Started is closed when the start hook of the restoration begins.
	Started() <-chan struct{}
}

// RestorationOut registers a Restoration from a constructor of another
// cell.
type RestorationOut struct {
	cell.Out
	Restoration Restoration `group:"identity-restorations"`
}

// NewRestoration returns a RestorationOut, for cell.Provide.
func NewRestoration(r Restoration) RestorationOut { return RestorationOut{Restoration: r} }

// Restoring marks ctx as restoration's own: local allocations made under it
// do not wait for restoration, which would then wait for itself. A
// Restoration passes it to the cells it asks for identities on its behalf
// (the ipcache, for the prefixes it re-creates); nothing else should.
func Restoring(ctx context.Context) context.Context {
	return context.WithValue(ctx, restoringKey{}, true)
}

type restoringKey struct{}

// Finalizer is work that must see every local allocation and release of
// the run: the allocator's stop hook runs it before the allocator stops
// its own work. Every cell that uses the allocator depends on it, so its
// stop hook has run by then, whatever the order in which the cells are
// listed. The checkpoint writes its final state there.
type Finalizer interface {
	Finalize(ctx context.Context) error
}

// FinalizerFunc adapts a function to Finalizer.
type FinalizerFunc func(ctx context.Context) error

// Finalize calls f.
func (f FinalizerFunc) Finalize(ctx context.Context) error { return f(ctx) }

// FinalizerOut registers a Finalizer from a constructor of another cell.
type FinalizerOut struct {
	cell.Out
	Finalizer Finalizer `group:"allocator-finalizers"`
}

// NewFinalizer returns a FinalizerOut, for cell.Provide.
func NewFinalizer(f Finalizer) FinalizerOut { return FinalizerOut{Finalizer: f} }

// contracts holds what other cells registered to order their work around
// the allocator's: the restorations local allocations wait for and the
// finalizers of the stop hook. Registration happens in an invoke, before
// any start hook; afterwards only open changes.
type contracts struct {
	// open is set once every restoration has finished (at once without
	// any): from then on a local allocation costs this one load.
	open         atomic.Bool
	restorations []Restoration
	finalizers   []Finalizer
	// timeout bounds an allocation's wait (--identity-allocation-timeout).
	timeout time.Duration
	log     *slog.Logger
	// warned is set once a wait for a restoration that had not started
	// was logged.
	warned atomic.Bool
}

// notStartedAfter is how long a local allocation waits for a restoration
// whose start hook has not begun before that is logged.
const notStartedAfter = time.Second

type contractsParams struct {
	cell.In

	Sink         *handlerSink
	Restorations []Restoration `group:"identity-restorations"`
	Finalizers   []Finalizer   `group:"allocator-finalizers"`
}

// registerContracts gives the allocator the restorations and finalizers
// other cells provide. It is an invoke for the reason registerHandlers is:
// a Restoration's constructor depends on the Allocator. Constructing them
// here also puts a Restoration's start hook right after the allocator's
// users constructed so far; the barrier, not that position, is what keeps
// their allocations after restoration's.
func registerContracts(p contractsParams) {
	c := p.Sink.contracts
	for _, r := range p.Restorations {
		if r != nil {
			c.restorations = append(c.restorations, r)
		}
	}
	for _, f := range p.Finalizers {
		if f != nil {
			c.finalizers = append(c.finalizers, f)
		}
	}
	c.open.Store(len(c.restorations) == 0)
}

// waitForRestoration returns once every restoration has finished, or with
// ctx's error. A finished restoration wins over an ended ctx, so that a
// caller with an ended context can still ask whether it has finished.
func (c *contracts) waitForRestoration(ctx context.Context) error {
	if c.open.Load() {
		return nil
	}
	for _, r := range c.restorations {
		select {
		case <-r.Done():
			continue
		default:
		}
		select {
		case <-r.Done():
		case <-ctx.Done():
			return fmt.Errorf("waiting for restoration: %w", context.Cause(ctx))
		}
	}
	c.open.Store(true)
	return nil
}

// errRestorationTimeout is the cause of a local allocation's wait that
// reached --identity-allocation-timeout; it is a deadline like any other.
var errRestorationTimeout = fmt.Errorf("restoration did not finish within --identity-allocation-timeout: %w", context.DeadlineExceeded)

// admit lets a local allocation through once restoration has finished.
// Restoration's own allocations (restored references, or under Restoring)
// go at once. The wait is bounded by ctx and the allocation timeout.
func (c *contracts) admit(ctx context.Context, restored bool) error {
	if c.open.Load() {
		// Small enough to be inlined: once open, this load is all a
		// local allocation pays.
		return nil
	}
	return c.wait(ctx, restored)
}

func (c *contracts) wait(ctx context.Context, restored bool) error {
	if restored || ctx.Value(restoringKey{}) != nil {
		return nil
	}
	ctx, cancel := context.WithTimeoutCause(ctx, c.timeout, errRestorationTimeout)
	defer cancel()
	if !c.warned.Load() {
		caller := callerOutside()
		t := time.AfterFunc(notStartedAfter, func() { c.warnNotStarted(caller) })
		defer t.Stop()
	}
	if err := c.waitForRestoration(ctx); err != nil {
		return fmt.Errorf("local identity: %w", err)
	}
	return nil
}

// warnNotStarted logs, once, that a local allocation of caller waits for
// a restoration whose start hook has not begun.
func (c *contracts) warnNotStarted(caller string) {
	if c.open.Load() || c.log == nil {
		return
	}
	for _, r := range c.restorations {
		s, ok := r.(RestorationStarter)
		if !ok {
			continue
		}
		select {
		case <-s.Started():
			continue
		default:
		}
		if c.warned.CompareAndSwap(false, true) {
			c.log.Error("A local identity allocation waits for restoration, whose start hook has not run: "+
				"an allocation from a start hook that runs before restoration's waits until --identity-allocation-timeout. "+
				"Make the cell that allocates at start depend on *restoration.Restorer, or allocate from a job",
				"caller", caller, "timeout", c.timeout)
		}
		return
	}
}

// callerOutside names the first function on the stack outside this
// package: the cell that asked for the allocation.
func callerOutside() string {
	var pcs [32]uintptr
	n := runtime.Callers(3, pcs[:])
	frames := runtime.CallersFrames(pcs[:n])
	const self = "github.com/identityd/identityd/cells/allocator."
	for {
		f, more := frames.Next()
		if f.Function != "" && !strings.HasPrefix(f.Function, self) && !strings.HasPrefix(f.Function, "runtime.") {
			return fmt.Sprintf("%s (%s:%d)", f.Function, f.File, f.Line)
		}
		if !more {
			return "unknown"
		}
	}
}

// admitBatch is admit for the requests of a batch that need it, waiting
// once for all of them. It returns nil or the error of those requests.
func (a *identityAllocator) admitBatch(ctx context.Context, reqs []Request) error {
	if a.contracts.open.Load() {
		return nil
	}
	for _, r := range reqs {
		if a.waitsForRestoration(r) {
			return a.contracts.admit(ctx, false)
		}
	}
	return nil
}

// waitsForRestoration tells whether the request is a local allocation
// that must wait for restoration.
func (a *identityAllocator) waitsForRestoration(r Request) bool {
	if r.Restored || a.reserved.LookupByLabels(r.Labels) != nil {
		return false
	}
	s := identity.ScopeForLabels(r.Labels)
	return s == identity.ScopeLocal || s == identity.ScopeRemoteNode
}

// finalize runs the finalizers, in registration order.
func (c *contracts) finalize(ctx context.Context) error {
	var errs []error
	for _, f := range c.finalizers {
		if err := f.Finalize(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func (a *identityAllocator) WaitForRestoration(ctx context.Context) error {
	return a.contracts.waitForRestoration(ctx)
}
