package crdstore

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync/atomic"

	"github.com/cilium/hive/cell"

	"github.com/identityd/identityd/identity"
)

// splitWatch wakes the identity-splits job, which reports the label sets
// this node holds under another ID than the one the rule picks now: nodes
// that allocate them from now on use the other one.
type splitWatch struct {
	wake chan struct{}
	// held is how many label sets the job reports; total counts the
	// label sets it found, once each time one came to be held split;
	// looks counts the job's looks over the split label sets.
	held  atomic.Int64
	total atomic.Uint64
	looks atomic.Uint64
}

func newSplitWatch() splitWatch { return splitWatch{wake: make(chan struct{}, 1)} }

// signalIfSplit wakes the job when the label set of key has more than one
// object: its release may end a split this node holds. The job's look
// goes over every split label set, so an allocation or a release of
// another set must not wake it (a node adopting thousands of duplicated
// sets would spend its time there).
func (w *splitWatch) signalIfSplit(c *identityCache, key string) {
	if c.objectCount(key) > 1 {
		w.signal()
	}
}

// signalIfHeld wakes the job when this node now holds the label set of key
// under id and the rule picks another of its objects.
func (w *splitWatch) signalIfHeld(c *identityCache, key string, id identity.NumericIdentity) {
	if c.objectCount(key) > 1 {
		if pick := c.lookup(key); pick == nil || pick.id != id {
			w.signal()
		}
	}
}

func (w *splitWatch) signal() {
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// placedReach bounds the walk of placedByWalkLocked: an object identityd
// placed further along its probe sequence than this (in a range almost
// full) counts as placed by another writer, whose duplicate is only
// logged at info level.
const placedReach = 1024

// placedGapSlack is how many slots of a probe sequence may be free before
// an object identityd placed: the collector frees slots a walk stepped
// over, after the walk placed its object further along.
const placedGapSlack = 16

// placedByWalkLocked reports whether e sits where identityd's walk places
// the objects of its label set: on the set's probe sequence, with no free
// slot before it past the first few. A Cilium agent picks its IDs at
// random, and the etcd store, whose objects a migration copies, in its own
// order: their objects are almost never there. Under mu.
func (c *identityCache) placedByWalkLocked(e *entry) bool {
	p := c.rng.probe(e.key)
	for i := range min(p.Len(), placedReach) {
		id := p.Slot(i)
		if id == e.id {
			return true
		}
		if i >= placedGapSlack && c.byID[id] == nil {
			return false
		}
	}
	return false
}

// reportDuplicateLocked logs a label set that came to have a second
// object, once for as long as it keeps more than one. Beside Cilium's
// agents, which read identities from a watch cache and so create
// duplicates of their own, a duplicate one of whose objects identityd's
// walk did not place is normal: it is logged at info level and counted in
// foreignSplits. One of two objects that identityd's walks both placed
// means that two identityd nodes answered the label set differently,
// which the rule exists to prevent: an error. Under mu.
func (c *identityCache) reportDuplicateLocked(key string, es []*entry) {
	ids := []identity.NumericIdentity{es[0].id, es[1].id}
	if c.placedByWalkLocked(es[0]) && c.placedByWalkLocked(es[1]) {
		c.log.Error("A global label set has two CiliumIdentity objects placed by identityd nodes; identityd nodes that allocate it use the one the rule picks",
			"labels", key, "ids", ids)
		return
	}
	c.foreignSplits.Add(1)
	c.log.Info("A global label set has a second CiliumIdentity object, placed by a Cilium agent or a migration, as happens beside Cilium's agents; identityd nodes that allocate it use the one the rule picks",
		"labels", key, "ids", ids)
}

// sortedByKey returns m's values in the order of their keys, so that the
// report of the same splits reads the same.
func sortedByKey(m map[string]error) []error {
	out := make([]error, 0, len(m))
	for _, k := range slices.Sorted(maps.Keys(m)) {
		out = append(out, m[k])
	}
	return out
}

// errSplitHeld: this node holds a label set under another ID than the
// rule's.
var errSplitHeld = errors.New("a global label set this node uses has another ID on the nodes that allocate it now")

// heldSplits returns, by label set, the error that names the ID this node
// holds and the rule's, for every label set with more than one object
// that this node holds under another object than the rule's pick.
func (s *Store) heldSplits() map[string]error {
	out := map[string]error{}
	if s.refs == nil {
		return out
	}
	for key, so := range s.ids.splits() {
		for _, id := range so.others {
			if r := s.refs.ByID(id); r != nil && r.Labels.Equal(so.lbls) {
				out[key] = fmt.Errorf("%w: %s: this node %d, the rule %d", errSplitHeld, key, id, so.pick)
				break
			}
		}
	}
	return out
}

// splitLoop is the identity-splits job. A node's holders keep the ID they
// have until they release it (the allocator counts references per label
// set); the label set's other users, on nodes that allocate it from now
// on, get the rule's. While both are in use, traffic of one label set
// carries two IDs, which every node maps to the same labels; it is
// reported (log, metric, and a health message that says degraded) until
// this node releases the ID or the rule picks it again.
//
// The health level stays OK: readiness says whether the node can serve,
// and it can: both IDs map to the same labels on every node, new users get
// the rule's, and the split converges as the holders release theirs. A
// Degraded level would hold the node unready for as long as its workloads
// live, and a restart would not end it either.
func (s *Store) splitLoop(ctx context.Context, h cell.Health) {
	reported := map[string]error{}
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.splits.wake:
		}
		s.splits.looks.Add(1)
		now := s.heldSplits()
		for key, err := range now {
			if _, ok := reported[key]; !ok {
				s.splits.total.Add(1)
				s.log.Error("A global label set this node uses has two CiliumIdentity objects and the rule picks the other one; this node's users keep theirs until they release it, new users get the rule's",
					"error", err)
			}
		}
		for key := range reported {
			if _, ok := now[key]; !ok {
				s.log.Info("A split global label set is no longer held under two IDs by this node", "labels", key)
			}
		}
		reported = now
		s.splits.held.Store(int64(len(now)))
		if h == nil {
			continue
		}
		if len(now) > 0 {
			h.OK(fmt.Sprintf("Degraded, serving: global label sets this node uses under another ID than the nodes that allocate them now: %d; new users get the rule's, this node's keep theirs until they release them: %v",
				len(now), errors.Join(sortedByKey(now)...)))
			continue
		}
		h.OK("No label set held under two IDs")
	}
}
