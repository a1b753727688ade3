package crdstore

import (
	"context"
	"errors"
	"runtime"
	"slices"
	"sync"
	"time"
	"weak"

	apierrors "k8s.io/apimachinery/pkg/api/errors"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/idprobe"
)

// reclaims reports whether this node's walks take the slot of an identity
// the collector would delete when they find no free one. Only a node that
// collects (a collection interval) and only without Cilium agents, whose
// uses are in the endpoint objects the collector would have to list for
// every such walk.
func (s *Store) reclaims() bool {
	return s.gc.cfg.Interval > 0 && !s.cfg.IdentityGCCiliumAgents
}

var (
	// errNothingToReclaim: no identity before the walk's position is one
	// the collector would delete now.
	errNothingToReclaim = errors.New("no identity to reclaim")
	// errReclaimLater: as errNothingToReclaim, but one is due within
	// reclaimHorizon.
	errReclaimLater = errors.New("an identity to reclaim is not due yet")
)

// waitToReclaim is called by a walk on a crowded range (SpaceWarnRatio)
// that would step over an identity the collector is about to delete (its
// mark reaches the timeout within reclaimHorizon, and nothing else keeps it)
// to create at a free slot, or to take the slot of one due now: the walk
// waits and walks again, once per reclaimRecheck, at most reclaimWait and
// a recheck from its first wait (twice reclaimWaitFull when it found no
// free slot) and at most half of the time left to the allocation, so that it takes
// that identity's slot once it is due (reclaim) rather than create behind
// it. An object created there would fence the whole run of held slots
// before it, which on a crowded range is much of the range, and while a
// released range refills, walks that keep creating at the ends of the
// same runs keep the released identities in them fenced. false: the walk
// has waited long enough, and creates (or reclaims) without waiting.
func (a *allocation) waitToReclaim(ctx context.Context, full bool) bool {
	now := time.Now()
	if a.reclaimWaitOver(now) {
		return false
	}
	if a.reclaimWaitUntil.IsZero() {
		// A walk that found no free slot waits for as long again as
		// its horizon once it began to wait, for the run's later
		// marks.
		wait := reclaimWait + reclaimRecheck
		if full {
			wait = 2 * reclaimWaitFull
		}
		a.reclaimWaitUntil = now.Add(wait)
		if deadline, ok := ctx.Deadline(); ok {
			// Half of what the caller gave is left to create.
			a.reclaimWaitUntil = minTime(a.reclaimWaitUntil, now.Add(deadline.Sub(now)/2))
		}
	}
	if ctx.Err() != nil {
		return false
	}
	t := time.NewTimer(min(reclaimRecheck, a.reclaimWaitUntil.Sub(now)))
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
	return true
}

// reclaimWaitOver reports whether the allocation has waited for identities
// to come due as long as waitToReclaim lets it.
func (a *allocation) reclaimWaitOver(now time.Time) bool {
	return !a.reclaimWaitUntil.IsZero() && !now.Before(a.reclaimWaitUntil)
}

// reclaimWait is how soon an identity must be due for a walk on a crowded
// range that found a free slot to wait for it (reclaimHorizon): a wait an
// allocation can afford, and longer than a collection run takes to mark
// what it released on an API server that answers promptly. On a range
// without a free slot the walk waits up to reclaimWaitFull: the
// allocation waits for space either way, and under load a run's marks
// are written over several seconds, so that 5 s would leave the steps
// over the run's last marks announced (docs/crd-store.md).
const (
	reclaimWait     = 5 * time.Second
	reclaimWaitFull = 30 * time.Second
)

// reclaimHorizon is how soon an identity must be due for a crowded walk to
// wait for it: full tells a walk that found no free slot.
func reclaimHorizon(full bool) time.Duration {
	if full {
		return reclaimWaitFull
	}
	return reclaimWait
}

// reclaimRecheck is how often a walk waiting to reclaim looks again.
const reclaimRecheck = time.Second

// reclaim takes, for the walk, the slot of the first identity among the
// first limit positions of p that the collector would delete now (decide,
// on this node's cache and listings of the IdentityNode records and
// Cilium's endpoint objects made after it): the identity is deleted with
// its UID and resourceVersion as preconditions, as the collector's delete,
// and the label set's object is created at its ID. A walk calls it when it
// found no free slot (limit: the whole sequence), and when it stepped over
// marked identities to a free slot (limit: that slot's position): a step
// over an identity the collector is about to delete would defer the
// delete (the step annotation, then the fence of the walk's new object),
// and on a refilling range the walks that keep stepping over the released
// identities would keep them for as long as the refill lasts. So a full
// range recovers as soon as its released identities' marks are old
// enough, without waiting for a collection. On a crowded range
// (SpaceWarnRatio), full or not, an identity that nothing but its mark's
// age keeps and that is due within reclaimHorizon ends the search with
// errReclaimLater (waitToReclaim), until the allocation has waited long
// enough.
// errNothingToReclaim: no such identity.
func (a *allocation) reclaim(ctx context.Context, p idprobe.Sequence, limit uint64) (identity.NumericIdentity, bool, error) {
	s := a.s
	// On a crowded range a walk may wait for an identity whose mark is
	// nearly old enough (errReclaimLater), until its wait is over;
	// elsewhere only one whose mark is old enough matters, and a refusal
	// costs no listing. That includes a range without a free slot: the
	// marks of one collection run come due within a second or so of
	// each other, and a walk that took the first one due further along
	// its sequence would announce its step over the others, deferring
	// their deletes by gcStepWindow; every later walk over them
	// announces again, and a full range that released its identities
	// kept them while it refilled.
	crowded := s.ids.fill() >= globalstore.SpaceWarnRatio && !a.reclaimWaitOver(time.Now())
	horizon := reclaimHorizon(limit >= p.Len())
	markedBefore := s.gc.clock().Add(-s.gcTimeout())
	if crowded {
		markedBefore = markedBefore.Add(horizon)
	}
	if a.readOnly || !s.reclaims() || !s.ids.anyMarkedBefore(p, limit, markedBefore) {
		return 0, false, errNothingToReclaim
	}
	g, err := s.reclaimInputs.get(ctx, s, a.walkStart)
	if err != nil {
		return 0, false, err
	}
	// g stays in use, and so gathered, until the walk is done with it.
	objs, in := g.objs, g.in
	defer runtime.KeepAlive(g)
	var stepped []*entry
	for i := range limit {
		id := p.Slot(i)
		at, found := slices.BinarySearchFunc(objs, id, func(o gcObject, id identity.NumericIdentity) int { return int(o.id) - int(id) })
		if !found {
			// Freed since the walk's look: walk again.
			return 0, false, errRestart
		}
		o := &objs[at]
		if o.e != nil && o.e.key == a.key {
			return 0, false, errRestart
		}
		if d := in.decide(o); d.action != gcDelete {
			if crowded && d.action == gcNone && d.kept == keptNot && dueWithin(o, in, horizon) {
				// Taking a slot further on would fence this
				// one, about to be due: wait for it instead.
				return 0, false, errReclaimLater
			}
			if o.e != nil && o.e.obj != nil && o.e.marked() {
				stepped = append(stepped, o.e)
			}
			continue
		}
		slot, mine := s.pending.claim(id, a.key, time.Now())
		if !mine {
			// Another walk of this node is taking this slot: once
			// it has, the slot is that walk's new object's.
			held, err := slot.wait(ctx)
			if err != nil {
				return 0, false, err
			}
			if held && slot.key != a.key {
				continue
			}
			return 0, false, errRestart
		}
		err := s.deleteIdentity(ctx, o)
		if err != nil && !apierrors.IsNotFound(err) {
			s.pending.finish(slot, true)
		}
		switch {
		case err == nil:
			s.gc.reclaimed.Add(1)
		case apierrors.IsNotFound(err):
			// Deleted by the collector meanwhile: free all the same.
		case apierrors.IsConflict(err):
			// Changed since the cache showed it: a use or a step won.
			if err := a.conflict(); err != nil {
				return 0, false, err
			}
			return 0, false, errRestart
		default:
			if err := a.retry(ctx, err); err != nil {
				return 0, false, err
			}
			return 0, false, errRestart
		}
		// The slot is free at the server, not yet in the cache: the
		// contention delay, which waits for the cache to show another
		// node's create there, would see the deleted object.
		a.stepped, a.waited, a.claimed = stepped, true, slot
		done, created, err := a.trySlot(ctx, id, nil)
		if a.claimed != nil {
			// The walk ended before its create.
			s.pending.finish(a.claimed, false)
			a.claimed = nil
		}
		if err != nil || done {
			return id, created, err
		}
		if err := a.conflict(); err != nil {
			return 0, false, err
		}
		return 0, false, errRestart
	}
	return 0, false, errNothingToReclaim
}

// reclaimInputs holds the inputs of the collector's decision (gcInputs)
// that a walk last gathered to reclaim: the identities from the cache and
// the listings of the IdentityNode records and Cilium's endpoint objects
// made after it. Walks that looked at the cache before they were gathered
// decide on them too, as the collector decides on the state at its run's
// start and acts on it for the run's length: what changed since fails the
// delete's preconditions. On a crowded range many walks reclaim at once,
// and each gathering copies the whole cache and lists every node's record,
// which lists nearly every ID: one per walk kept the allocations of a
// refilling full range waiting past a minute.
// The inputs are held weakly: a copy of the whole cache stays in memory
// only while walks use it.
type reclaimInputs struct {
	mu   sync.Mutex
	last weak.Pointer[gathered]
}

// gathered is one gathering of reclaimInputs, at its time.
type gathered struct {
	at   time.Time
	objs []gcObject
	in   *gcInputs
}

// get returns inputs gathered after since, gathering them if the last
// ones are older or gone; one walk gathers while the others wait for it.
func (r *reclaimInputs) get(ctx context.Context, s *Store, since time.Time) (*gathered, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if g := r.last.Value(); g != nil && !g.at.Before(since) {
		return g, nil
	}
	objs, _, in, err := s.gather(ctx)
	if err != nil {
		return nil, err
	}
	g := &gathered{at: in.now, objs: objs, in: in}
	r.last = weak.Make(g)
	return g, nil
}

// dueWithin reports whether o carries a mark that reaches the collector's
// timeout within d of in's now.
func dueWithin(o *gcObject, in *gcInputs, d time.Duration) bool {
	at, err := time.Parse(time.RFC3339Nano, o.obj.Annotations[HeartbeatAnnotation])
	return err == nil && at.Add(in.timeout).Sub(in.now) <= d
}

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}
