package crdstore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/identityd/identityd/internal/retry"

	"github.com/cilium/hive/cell"
	"github.com/go-logr/logr"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// nodeWriter coalesces the writes of this node's IdentityNode: one write in
// flight, and the next carries every change made since the last one began.
type nodeWriter struct {
	wake chan struct{}
	// renew asks the next write to happen even if nothing changed.
	renew atomic.Bool
	// lastOK is the time of the last successful write (Unix nanoseconds).
	lastOK atomic.Int64
	// writes and failures count the writes sent.
	writes, failures atomic.Uint64
	// recreated counts the times the watch found the record deleted.
	recreated atomic.Uint64
}

// nodeWriteWindow is the time a write waits for more changes to carry.
// It is far below the heartbeat timeout that a use not yet written relies
// on (a marked identity this node uses is unmarked by the watch anyway).
const nodeWriteWindow = 500 * time.Millisecond

func newNodeWriter() nodeWriter { return nodeWriter{wake: make(chan struct{}, 1)} }

// request asks for a write; renew forces it when nothing changed.
func (w *nodeWriter) request(renew bool) {
	if renew {
		w.renew.Store(true)
	}
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// heldIDs returns the sorted IDs of the allocator's record of this node's
// references, which is what the IdentityNode says.
func (s *Store) heldIDs() []uint32 {
	var ids []uint32
	if s.refs != nil {
		s.refs.Each(func(r *globalstore.Reference) { ids = append(ids, uint32(r.ID)) })
	}
	slices.Sort(ids)
	return slices.Compact(ids)
}

// ownRecord is the writer's view of this node's IdentityNode, kept by the
// writer job alone.
type ownRecord struct {
	loaded bool
	// rv is the resourceVersion of the last write (or read): the next
	// write sends it as a precondition, so that a write by anyone else
	// in between shows as a conflict.
	rv string
	// carried are the identities of the record an earlier process of
	// this node left, kept in the record until that record's lease would
	// have ended: a restart must not end the node's claims sooner than
	// its death would have (the workloads of a restarted node allocate
	// their identities again, but not at once).
	carried      []uint32
	carriedUntil time.Time
	// sharedUntil is set when someone else wrote the record: health
	// reports it for a lease.
	sharedUntil time.Time
}

// ErrNodeNameInUse: another live agent uses this node name: its
// IdentityNode names another process that runs, and its lease has not
// ended.
var ErrNodeNameInUse = globalstore.ErrNodeNameInUse

// claimNodeName reads the IdentityNode an earlier process of this node
// left, at start: a live record of another running agent fails the start
// (as the etcd store's node key does); the record of one that is gone (same
// host, its process ended, or a record without a holder) is taken over, and
// its identities carried (ownRecord). When the read fails, the writer reads
// again before its first write.
func (s *Store) claimNodeName(ctx context.Context) error {
	var rec ownRecord
	old, err := s.loadOwnRecord(ctx, &rec)
	if err != nil {
		s.log.Warn("Cannot read this node's IdentityNode at start; the writer reads it before its first write", "node", s.node, "error", err)
		return nil
	}
	if old != nil && old.Spec.Holder != nil && old.Spec.Holder.Instance != s.claim.Instance && !old.Expired(metav1.Now()) {
		h := *old.Spec.Holder
		if !s.claim.Gone(h) {
			return fmt.Errorf("%w: --node-name %q is used by the agent of %s (IdentityNode %s, renewed %s, lease %ds); give each agent its own node name",
				ErrNodeNameInUse, s.node, h, s.node, old.Spec.RenewTime.UTC().Format(time.RFC3339), old.Spec.LeaseDurationSeconds)
		}
		s.log.Info("Took over the node name from an agent that is gone", "node", s.node, "previous", h.String())
		prev := s.node + holderSeparator + h.Instance
		s.predecessor.Store(&prev)
	}
	s.claim.Hold()
	s.startRecord = rec
	return nil
}

// loadOwnRecord reads the record an earlier process left into rec, and
// returns it (nil when there is none).
func (s *Store) loadOwnRecord(ctx context.Context, rec *ownRecord) (*IdentityNode, error) {
	var old IdentityNode
	err := s.nodeClient.Get().Resource("identitynodes").Name(s.node).Do(ctx).Into(&old)
	switch {
	case apierrors.IsNotFound(err):
		rec.loaded = true
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("reading IdentityNode %s: %w", s.node, err)
	}
	rec.rv = old.ResourceVersion
	until := old.Spec.RenewTime.Add(time.Duration(old.Spec.LeaseDurationSeconds) * time.Second)
	if len(old.Spec.Identities) > 0 && time.Now().Before(until) {
		rec.carried, rec.carriedUntil = slices.Clone(old.Spec.Identities), until
		s.log.Info("Keeping the identities of this node's earlier record until its lease ends",
			"node", s.node, "identities", len(rec.carried), "until", until)
	}
	rec.loaded = true
	return &old, nil
}

// idsToWrite is what the record lists now: the held identities and, until
// their time ends, the carried ones.
func (rec *ownRecord) idsToWrite(held []uint32, now time.Time) []uint32 {
	if rec.carried == nil {
		return held
	}
	if !now.Before(rec.carriedUntil) {
		rec.carried = nil
		return held
	}
	ids := append(slices.Clone(held), rec.carried...)
	slices.Sort(ids)
	return slices.Compact(ids)
}

// writeLoop is the IdentityNode writer job.
func (s *Store) writeLoop(ctx context.Context, h cell.Health) {
	var (
		rec      = s.startRecord
		last     []uint32
		written  bool
		failures int
		// carryEnd fires when the carried identities leave the
		// record; nil while none are carried or once it fired.
		carryEnd *time.Timer
	)
	defer func() {
		if carryEnd != nil {
			carryEnd.Stop()
		}
	}()
	for {
		var carryEnded <-chan time.Time
		if carryEnd != nil {
			carryEnded = carryEnd.C
		}
		select {
		case <-ctx.Done():
			return
		case <-s.writer.wake:
		case <-carryEnded:
			carryEnd = nil
		}
		// Let the changes of the next moment join this write: the
		// record must follow allocations within seconds, not at
		// once (docs/crd-store.md), and one write per allocation
		// would double the API server's work for a new identity.
		if written {
			retry.Sleep(ctx, nodeWriteWindow)
		}
		renew := s.writer.renew.Swap(false)
		var err error
		if !rec.loaded {
			_, err = s.loadOwnRecord(ctx, &rec)
		}
		if err == nil && rec.carried != nil && carryEnd == nil {
			// Armed again only if it fired a moment before the
			// wall clock reached the end.
			carryEnd = time.NewTimer(time.Until(rec.carriedUntil))
		}
		var ids []uint32
		if err == nil {
			ids = rec.idsToWrite(s.heldIDs(), time.Now())
			same := written && slices.Equal(ids, last)
			if same && !renew {
				continue
			}
			err = s.writeNode(ctx, ids, &rec, !same)
		}
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			failures++
			s.writer.failures.Add(1)
			s.log.Warn("Writing this node's IdentityNode failed; retrying", "node", s.node, "error", err, "attempt", failures)
			if h != nil {
				h.Degraded("Writing IdentityNode "+s.node+" failed", health.External(err))
			}
			// Try again with whatever is held by then.
			s.writer.request(renew)
			retry.Sleep(ctx, retry.Backoff(failures))
			continue
		}
		failures = 0
		last, written = ids, true
		s.writer.lastOK.Store(time.Now().UnixNano())
		if h == nil {
			continue
		}
		if time.Now().Before(rec.sharedUntil) {
			h.Degraded("IdentityNode "+s.node+" shared", health.External(fmt.Errorf(
				"IdentityNode %s was written by someone else since this agent's last write: does another agent run with --node-name %s? Its uses and this agent's overwrite each other", s.node, s.node)))
			continue
		}
		h.OK(fmt.Sprintf("IdentityNode %s lists %d identities", s.node, len(ids)))
	}
}

// writeNode writes this node's IdentityNode with ids and a fresh renewal
// time: a merge patch of its spec, with the resourceVersion of the last
// write as precondition, or a create when it does not exist. A renewal
// (full false: the record holds ids since this node's last write) patches
// the renewal time alone. Either asks for the object's metadata only in
// the answer: a renewal's answer would otherwise be the whole record,
// every lease/3 from every node (docs/benchmarks.md, "Cluster scale").
func (s *Store) writeNode(ctx context.Context, ids []uint32, rec *ownRecord, full bool) error {
	if ids == nil {
		ids = []uint32{}
	}
	spec := IdentityNodeSpec{
		Identities:           ids,
		RenewTime:            metav1.NewMicroTime(time.Now()),
		LeaseDurationSeconds: int32(s.cfg.IdentityNodeLeaseTTL / time.Second),
		Holder:               &s.claim,
	}
	s.writer.writes.Add(1)
	var err error
	for range 3 {
		var body map[string]any
		if full || rec.rv == "" {
			body = map[string]any{"spec": spec}
		} else {
			body = map[string]any{"spec": map[string]any{"renewTime": spec.RenewTime}}
		}
		if rec.rv != "" {
			body["metadata"] = map[string]any{"resourceVersion": rec.rv}
		}
		patch, merr := json.Marshal(body)
		if merr != nil {
			return merr
		}
		var rv string
		rv, err = patchMetadataOnly(ctx, s.nodeClient, "identitynodes", s.node, patch)
		switch {
		case err == nil:
			rec.rv = rv
			return nil
		case apierrors.IsConflict(err):
			// Whoever wrote the record may have changed its
			// identities: the next attempt writes them all.
			full = true
			// Nothing but this node's writer changes the record
			// of a live node: another process does, under the same
			// --node-name.
			var cur IdentityNode
			if gerr := s.nodeClient.Get().Resource("identitynodes").Name(s.node).Do(ctx).Into(&cur); gerr != nil {
				return gerr
			}
			rec.rv = cur.ResourceVersion
			rec.sharedUntil = time.Now().Add(s.cfg.IdentityNodeLeaseTTL)
			holder := "none"
			if cur.Spec.Holder != nil {
				holder = cur.Spec.Holder.String()
			}
			s.log.Error("IdentityNode of this node was written by someone else; is --node-name used by two agents?",
				"node", s.node, "holder", holder, "identities", cur.Spec.Identities, "renew-time", cur.Spec.RenewTime.Time)
			continue
		case !apierrors.IsNotFound(err):
			return err
		}
		obj := &IdentityNode{
			TypeMeta:   metav1.TypeMeta{APIVersion: IdentityGroup + "/" + IdentityVersion, Kind: "IdentityNode"},
			ObjectMeta: metav1.ObjectMeta{Name: s.node},
			Spec:       spec,
		}
		var got IdentityNode
		err = s.nodeClient.Post().Resource("identitynodes").Body(obj).Do(ctx).Into(&got)
		switch {
		case err == nil:
			rec.rv = got.ResourceVersion
			return nil
		case apierrors.IsAlreadyExists(err):
			rec.rv = ""
		default:
			return err
		}
	}
	return err
}

// watchOwnRecord is the job that watches this node's own IdentityNode, one
// object selected by its name, so that a record deleted under the running
// node (kubectl delete identitynode, or a collector that judged its lease
// over while this node was cut off) is written again at once rather than
// at the next renewal, a third of a lease later: meanwhile the collector
// sees none of this node's uses, and may mark and, past the grace, delete
// identities this node's users hold. The watch brings this node's own
// writes back to it, one event per write, and no other node's; it asks for
// the object's metadata only, as the writes' answers do, so that an event
// does not carry the record's list of identities.
func (s *Store) watchOwnRecord(ctx context.Context, h cell.Health) {
	meta, err := metadata.NewForConfig(s.rest)
	if err != nil {
		// The store's own clients were built from the same config.
		s.log.Error("Cannot watch this node's IdentityNode", "node", s.node, "error", err)
		if h != nil {
			h.Degraded("Watching IdentityNode "+s.node, err)
		}
		return
	}
	records := meta.Resource(schema.GroupVersionResource{Group: IdentityGroup, Version: IdentityVersion, Resource: "identitynodes"})
	selector := fields.OneTermEqualSelector("metadata.name", s.node).String()
	store := &ownRecordWatch{s: s}
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
			opts.FieldSelector = selector
			store.writtenBeforeList.Store(s.writer.lastOK.Load() != 0)
			return records.List(ctx, opts)
		},
		WatchFuncWithContext: func(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
			opts.FieldSelector = selector
			if opts.SendInitialEvents != nil && *opts.SendInitialEvents {
				// A watch that lists (client-go's watch-list) ends its
				// initial events with a Replace, as a listing does.
				store.writtenBeforeList.Store(s.writer.lastOK.Load() != 0)
			}
			return records.Watch(ctx, opts)
		},
	}
	if h != nil {
		// The API server's reachability is the CiliumIdentity watch's
		// to report; this one only says what it watches.
		h.OK("Watching IdentityNode " + s.node)
	}
	logger := logr.FromSlogHandler(s.log.Handler())
	r := cache.NewReflectorWithOptions(lw, &metav1.PartialObjectMetadata{}, store,
		cache.ReflectorOptions{Name: "identitynodes/" + s.node, Logger: &logger})
	r.RunWithContext(ctx)
}

// ownRecordWatch receives the watch of this node's IdentityNode.
type ownRecordWatch struct {
	s *Store
	// writtenBeforeList is whether the writer had written the record
	// when the last listing began: a listing that began before the first
	// write completed may well lack the record.
	writtenBeforeList atomic.Bool
}

func (w *ownRecordWatch) Add(any) error    { return nil }
func (w *ownRecordWatch) Update(any) error { return nil }
func (w *ownRecordWatch) Resync() error    { return nil }

func (w *ownRecordWatch) Delete(any) error {
	w.s.recordGone("deleted")
	return nil
}

// Replace is a listing: a record that this node wrote before the listing
// began and that the listing lacks was deleted while the watch was broken.
// Before the first write, a missing record is the start's, which the
// writer writes anyway.
func (w *ownRecordWatch) Replace(list []any, _ string) error {
	if len(list) == 0 && w.writtenBeforeList.Load() {
		w.s.recordGone("missing from a listing")
	}
	return nil
}

// recordGone asks the writer to write this node's IdentityNode again now:
// its write finds the record gone and creates it with every identity this
// node holds. Logged once per deletion.
func (s *Store) recordGone(how string) {
	if s.stopped.Load() {
		return
	}
	s.writer.recreated.Add(1)
	s.log.Warn("This node's IdentityNode was deleted; writing it again now", "node", s.node, "how", how)
	s.writer.request(true)
}

// metadataOnly asks the API server to answer with the object's metadata
// (a PartialObjectMetadata) instead of the whole object.
const metadataOnly = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"

// patchMetadataOnly sends a JSON merge patch of resource's object name and
// returns the resourceVersion it got. Errors are the API server's, as
// apierrors classifies them.
func patchMetadataOnly(ctx context.Context, c rest.Interface, resource, name string, patch []byte) (string, error) {
	raw, err := c.Patch(types.MergePatchType).Resource(resource).Name(name).
		SetHeader("Accept", metadataOnly).Body(patch).Do(ctx).Raw()
	if err != nil {
		return "", err
	}
	var got metav1.PartialObjectMetadata
	if err := json.Unmarshal(raw, &got); err != nil {
		return "", fmt.Errorf("reading the answer to a patch of %s %s: %w", resource, name, err)
	}
	if got.ResourceVersion == "" {
		return "", fmt.Errorf("the answer to a patch of %s %s has no resourceVersion", resource, name)
	}
	return got.ResourceVersion, nil
}

// renewTick is the renewal timer's work: it asks the writer for a write,
// and reports a record that has not been written for half its lease.
func (s *Store) renewTick() error {
	s.writer.request(true)
	last := s.writer.lastOK.Load()
	if last == 0 {
		return nil
	}
	if age := time.Since(time.Unix(0, last)); age > s.cfg.IdentityNodeLeaseTTL/2 {
		return health.External(fmt.Errorf("IdentityNode %s last renewed %s ago, lease %s", s.node, age.Round(time.Second), s.cfg.IdentityNodeLeaseTTL))
	}
	return nil
}

// unmarkQueue holds IDs this node uses whose objects got the heartbeat
// mark.
// and those whose objects someone deleted (lostIDs).
type unmarkQueue struct {
	mu      sync.Mutex
	ids     map[identity.NumericIdentity]struct{}
	lostIDs map[identity.NumericIdentity]struct{}
	wake    chan struct{}
	// taken is how many IDs the unmark job holds as taken by another
	// label set: releases wake the job only while there are some.
	taken atomic.Int32
}

func newUnmarkQueue() unmarkQueue {
	return unmarkQueue{
		ids:     map[identity.NumericIdentity]struct{}{},
		lostIDs: map[identity.NumericIdentity]struct{}{},
		wake:    make(chan struct{}, 1),
	}
}

func (q *unmarkQueue) push(id identity.NumericIdentity) {
	q.mu.Lock()
	q.ids[id] = struct{}{}
	q.mu.Unlock()
	q.signal()
}

func (q *unmarkQueue) lost(id identity.NumericIdentity) {
	q.mu.Lock()
	q.lostIDs[id] = struct{}{}
	q.mu.Unlock()
	q.signal()
}

func (q *unmarkQueue) signal() {
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

func (q *unmarkQueue) take() (marked, lost []identity.NumericIdentity) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for id := range q.ids {
		marked = append(marked, id)
	}
	for id := range q.lostIDs {
		lost = append(lost, id)
	}
	clear(q.ids)
	clear(q.lostIDs)
	return marked, lost
}

// markSeen is the cache's hook for an object that carries the heartbeat
// mark: when this node uses it, the mark is removed, as Cilium's agents
// do, so that the collector's delete (with the marked resourceVersion as
// precondition) fails even while this node's IdentityNode write does.
func (s *Store) markSeen(id identity.NumericIdentity, lbls labels.Labels) {
	if s.stopped.Load() || s.refs == nil {
		return
	}
	if r := s.refs.ByID(id); r != nil && r.Labels.Equal(lbls) {
		s.unmarks.push(id)
	}
}

// errIdentityTaken: the CiliumIdentity of an ID this node uses holds
// another label set.
var errIdentityTaken = errors.New("a global identity this node uses belongs to another label set")

// recreate writes back the object of an identity this node still uses
// after someone deleted it (the collector deletes only unused ones; an
// administrator or a collector that does not see identityd's records may
// not): another node would otherwise give the ID to another label set
// while this node's users hold it, as Cilium's agents re-create it. When
// the ID was given to another label set meanwhile (or its object rewritten),
// nothing can make both right, and other nodes apply that label set's
// policy to this node's users of the ID: it returns errIdentityTaken.
func (s *Store) recreate(ctx context.Context, id identity.NumericIdentity) error {
	ref := s.refs.ByID(id)
	if ref == nil {
		return nil
	}
	if e := s.ids.get(id); e != nil {
		return takenBy(id, ref.Labels, e.lbls, nil)
	}
	err := s.create(ctx, id, ref.Labels)
	switch {
	case err == nil:
		s.log.Warn("CiliumIdentity of a global identity this node uses was deleted; re-created it", "id", id, "labels", ref.Labels.Canonical())
		return nil
	case apierrors.IsAlreadyExists(err):
		var obj CiliumIdentity
		if err := s.ciliumClient.Get().Resource("ciliumidentities").Name(id.String()).Do(ctx).Into(&obj); err != nil {
			return err
		}
		got, perr := parseSecurityLabels(obj.SecurityLabels)
		return takenBy(id, ref.Labels, got, perr)
	}
	return err
}

// takenBy returns errIdentityTaken unless the object of id holds mine.
func takenBy(id identity.NumericIdentity, mine, theirs labels.Labels, parseErr error) error {
	switch {
	case parseErr != nil:
		return fmt.Errorf("%w: %d is %s on this node; its CiliumIdentity's security-labels are not a label set: %w", errIdentityTaken, id, mine.Canonical(), parseErr)
	case !theirs.Equal(mine):
		return fmt.Errorf("%w: %d is %s on this node, %s in its CiliumIdentity", errIdentityTaken, id, mine.Canonical(), theirs.Canonical())
	}
	return nil
}

// unmarkLoop is the job that removes marks from identities this node
// uses, and re-creates deleted ones it uses.
func (s *Store) unmarkLoop(ctx context.Context, h cell.Health) {
	if s.adoptOnly {
		if h != nil {
			h.OK("Operator mode: the identity manager removes heartbeat marks and re-creates deleted identities")
		}
		<-ctx.Done()
		return
	}
	failures := 0
	// taken holds the IDs this node uses whose objects hold another
	// label set, with what was found.
	taken := map[identity.NumericIdentity]error{}
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.unmarks.wake:
		}
		var failed error
		marked, lost := s.unmarks.take()
		// IDs found taken are looked at again every round: released,
		// given back, or deleted (and then re-created).
		for id := range taken {
			if !slices.Contains(lost, id) {
				lost = append(lost, id)
			}
		}
		for _, id := range lost {
			err := s.recreate(ctx, id)
			switch {
			case errors.Is(err, errIdentityTaken):
				if taken[id] == nil {
					s.stats.taken.Add(1)
					s.log.Error("Global identity this node uses now belongs to another label set; other nodes apply that label set's policy to it until this node's users release it",
						"id", id, "error", err)
				}
				taken[id] = err
			case err != nil:
				// Tried again next round; a taken ID stays taken
				// until a round shows otherwise.
				failed = err
				s.unmarks.lost(id)
			default:
				delete(taken, id)
			}
		}
		s.unmarks.taken.Store(int32(len(taken)))
		for _, id := range marked {
			e := s.ids.get(id)
			if e == nil || !e.marked() || s.refs.ByID(id) == nil {
				continue
			}
			err := s.unmark(ctx, id, e.obj.ResourceVersion)
			switch {
			case err == nil, apierrors.IsConflict(err), apierrors.IsNotFound(err):
				// A newer version comes with the watch, and is
				// looked at again if it is still marked.
			default:
				failed = err
				s.unmarks.push(id)
			}
		}
		if failed != nil && ctx.Err() == nil {
			failures++
			s.log.Warn("Removing the heartbeat mark of a global identity this node uses failed; retrying", "error", failed)
			if h != nil {
				h.Degraded("Removing heartbeat marks failed", health.External(failed))
			}
			retry.Sleep(ctx, retry.Backoff(failures))
			continue
		}
		failures = 0
		if h == nil {
			continue
		}
		if len(taken) > 0 {
			// Not ready, but not dead: the users of the IDs decide
			// when they are released.
			h.Degraded("A global identity this node uses belongs to another label set",
				health.External(errors.Join(slices.Collect(maps.Values(taken))...)))
			continue
		}
		h.OK("No marked identity in use")
	}
}
