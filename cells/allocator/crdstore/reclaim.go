package crdstore

import (
	"context"
	"errors"
	"slices"
	"time"

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
	// reclaimWait.
	errReclaimLater = errors.New("an identity to reclaim is not due yet")
)

// waitToReclaim is called by a walk on a crowded range (SpaceWarnRatio)
// that would step over an identity the collector is about to delete (its
// mark reaches the timeout within reclaimWait, and nothing else keeps it)
// to create at a free slot: the walk waits and walks again, once per
// reclaimRecheck, at most reclaimWait and a recheck from its first wait
// and at most half of the time left to the allocation, so that it takes
// that identity's slot once it is due (reclaim) rather than create behind
// it. An object created there would fence the whole run of held slots
// before it, which on a crowded range is much of the range, and while a
// released range refills, walks that keep creating at the ends of the
// same runs keep the released identities in them fenced. false: the walk
// has waited long enough, and creates.
func (a *allocation) waitToReclaim(ctx context.Context) bool {
	now := time.Now()
	if a.reclaimWaitUntil.IsZero() {
		a.reclaimWaitUntil = now.Add(reclaimWait + reclaimRecheck)
		if deadline, ok := ctx.Deadline(); ok {
			// Half of what the caller gave is left to create.
			a.reclaimWaitUntil = minTime(a.reclaimWaitUntil, now.Add(deadline.Sub(now)/2))
		}
	}
	if !now.Before(a.reclaimWaitUntil) || ctx.Err() != nil {
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

// reclaimWait is how soon an identity must be due for a walk on a crowded
// range to wait for it: a wait an allocation can afford, and longer than
// a collection run takes to mark what it released, so that the marks of
// one run come due within it of each other.
const reclaimWait = 5 * time.Second

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
// (SpaceWarnRatio), for a walk that found a free slot, an identity that
// nothing but its mark's age keeps and that is due within reclaimWait
// ends the search with errReclaimLater (waitToReclaim).
// errNothingToReclaim: no such identity.
func (a *allocation) reclaim(ctx context.Context, p idprobe.Sequence, limit uint64) (identity.NumericIdentity, bool, error) {
	s := a.s
	// On a crowded range a walk that found a free slot may wait for an
	// identity whose mark is nearly old enough (errReclaimLater);
	// elsewhere, and on a range without a free slot, where the
	// allocation is refused at once, only one whose mark is old enough
	// matters: a refusal then costs no listing.
	crowded := limit < p.Len() && s.ids.fill() >= globalstore.SpaceWarnRatio
	markedBefore := time.Now().Add(-s.gcTimeout())
	if crowded {
		markedBefore = markedBefore.Add(reclaimWait)
	}
	if a.readOnly || !s.reclaims() || !s.ids.anyMarkedBefore(p, limit, markedBefore) {
		return 0, false, errNothingToReclaim
	}
	now := time.Now()
	objs := s.gcIdentities()
	nodes, err := s.listGCNodes(ctx)
	if err != nil {
		return 0, false, err
	}
	named, err := s.listEndpointIdentities(ctx)
	if err != nil {
		return 0, false, err
	}
	in := s.gcInputs(now, objs, nodes, named)
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
			if crowded && d.action == gcNone && d.kept == keptNot && dueWithin(o, in, reclaimWait) {
				// Taking a slot further on would fence this
				// one, about to be due: wait for it instead.
				return 0, false, errReclaimLater
			}
			if o.e != nil && o.e.obj != nil && o.e.marked() {
				stepped = append(stepped, o.e)
			}
			continue
		}
		switch err := s.deleteIdentity(ctx, o); {
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
		a.stepped, a.waited = stepped, true
		done, created, err := a.trySlot(ctx, id, nil)
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
