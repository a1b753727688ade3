package crdstore

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"golang.org/x/time/rate"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/identity"
)

// GCConfig configures the garbage collection of CiliumIdentity and
// IdentityNode objects. The flags that set it belong to the stores' shared
// configuration; the cell takes a GCConfig from the hive when one is
// provided, and DefaultGCConfig otherwise.
type GCConfig struct {
	// Interval is the period of the collection; 0 disables it.
	Interval time.Duration
	// RateLimit is the most identities deleted per RateInterval.
	RateLimit int64
	// RateInterval is the window of RateLimit.
	RateInterval time.Duration
	// HeartbeatTimeout is how long an unused identity carries the
	// heartbeat mark before it is deleted (Cilium operator's
	// --identity-heartbeat-timeout).
	HeartbeatTimeout time.Duration
}

// DefaultGCConfig is Cilium's: a run every 15 minutes, at most 2500
// deletions a minute, deletion 30 minutes after the mark.
var DefaultGCConfig = GCConfig{
	Interval:         15 * time.Minute,
	RateLimit:        2500,
	RateInterval:     time.Minute,
	HeartbeatTimeout: 30 * time.Minute,
}

// MinHeartbeatTimeout is the shortest HeartbeatTimeout. The fence's
// safety rests on it: a creator whose last look (recheck) saw a slot held
// and unmarked created its object less than maxCacheLag after the slot's
// mark, so a run that finds the mark this old has a cache that shows the
// object, whose fence keeps the slot while it is young
// (docs/crd-store.md).
const MinHeartbeatTimeout = 2 * maxCacheLag

// Validate checks the configuration.
func (c GCConfig) Validate() error {
	if err := c.validateBasic(); err != nil {
		return err
	}
	if c.HeartbeatTimeout < MinHeartbeatTimeout {
		return fmt.Errorf("--identity-heartbeat-timeout must be at least %s in crd mode, not %s", MinHeartbeatTimeout, c.HeartbeatTimeout)
	}
	return nil
}

// validateBasic checks what every configuration needs, whatever its
// durations.
func (c GCConfig) validateBasic() error {
	switch {
	case c.Interval < 0:
		return errors.New("--identity-gc-interval must not be negative")
	case c.RateLimit <= 0:
		return errors.New("--identity-gc-rate-limit must be positive")
	case c.RateInterval <= 0:
		return errors.New("--identity-gc-rate-interval must be positive")
	case c.HeartbeatTimeout <= 0:
		return errors.New("--identity-heartbeat-timeout must be positive")
	}
	return nil
}

// gcListPageSize is the page size of the collector's listings.
const gcListPageSize = 500

// gcState is the collector's configuration, pacing and counters.
type gcState struct {
	cfg     GCConfig
	limiter *rate.Limiter

	runs, failed             atomic.Uint64
	marked, deleted, skipped atomic.Uint64
	unmarked, nodesDeleted   atomic.Uint64
	// reclaimed counts the identities walks deleted to take their
	// slots (reclaim).
	reclaimed atomic.Uint64
	// keptUsed and keptFenced are the last run's counts.
	keptUsed, keptFenced atomic.Uint64

	// endpoints is what the last run learned of the CiliumEndpoint and
	// CiliumEndpointSlice objects.
	endpoints endpointState
	// pageSize is the page size of the listings of Cilium's endpoint
	// objects (gcListPageSize; tests make it small).
	pageSize int64

	// beforeDelete, when set (by tests), runs before each delete of an
	// identity.
	beforeDelete func(*gcObject)
	// stepWindow is how long a step annotation defers a delete
	// (gcStepWindow; tests make it short).
	stepWindow time.Duration
	// deletesInFlight bounds the deletes sent and not yet answered
	// (deletesInFlight of the configuration).
	deletesInFlight int
	// minGrace is the shortest grace without Cilium agents
	// (MinHeartbeatTimeout; tests make it short).
	minGrace time.Duration
	// clock is the collector's clock: the time of its marks and the now
	// its decisions compare marks, leases and creations with (time.Now;
	// tests move it on rather than wait through a heartbeat timeout).
	clock func() time.Time
}

func newGCState(cfg GCConfig) *gcState {
	perDeletion := cfg.RateInterval / time.Duration(max(cfg.RateLimit, 1))
	// A burst of one keeps every window of the interval within the limit.
	return &gcState{cfg: cfg, limiter: rate.NewLimiter(rate.Every(perDeletion), 1), pageSize: gcListPageSize, stepWindow: gcStepWindow, minGrace: MinHeartbeatTimeout, deletesInFlight: cfg.deletesInFlight(), clock: time.Now}
}

// setGCConfig replaces the garbage collection's configuration, before the
// store registers its jobs.
func (s *Store) setGCConfig(c GCConfig) error {
	if err := c.Validate(); err != nil {
		return err
	}
	s.gc = newGCState(c)
	return nil
}

// registerGC adds the collector's jobs to the store's: the election of
// the one node of the cluster that collects, and the timer, whose runs
// happen only while this node is that one. A node that does not collect
// does not campaign either.
func (s *Store) registerGC(g job.Group) {
	if s.gc.cfg.Interval <= 0 {
		return
	}
	g.Add(oneShot("identity-gc-election", func(ctx context.Context, h cell.Health) {
		timings := s.electionTimings
		if timings == (electionTimings{}) {
			timings = gcElectionTimings(s.cfg.IdentityNodeLeaseTTL)
		}
		el := newGCElection(s, timings)
		s.election.Store(el)
		el.run(ctx, h)
	}))
	// Its own scope, which the timer's reports do not overwrite: whether
	// the collector found Cilium's endpoint objects to count.
	g.Add(oneShot("identity-gc-endpoints", func(ctx context.Context, h cell.Health) {
		s.gc.endpoints.attach(h)
		<-ctx.Done()
		s.gc.endpoints.attach(nil)
	}))
	g.Add(globalstore.CollectionJob("identity-gc", s.gc.cfg.Interval, s.log, globalstore.Collection{
		What: "CiliumIdentity objects",
		// Nothing to collect before the first listing, and nothing once
		// the store stopped.
		Ready: func() bool { return !s.stopped.Load() && s.ids.isSynced() },
		Term: func() context.Context {
			if el := s.election.Load(); el != nil {
				return el.leading()
			}
			return nil
		},
		Pass: s.collect,
	}))
}

// gcObject is one listed CiliumIdentity of this cluster's range.
type gcObject struct {
	id  identity.NumericIdentity
	e   *entry // nil: labels that do not parse; the object holds its ID all the same
	obj CiliumIdentity
}

// collect is one collection. It decides on the store's watch cache of
// CiliumIdentity objects, read under one lock at the start of the run (a
// state the API server had: the cache is a consistent prefix of its
// history), and on its own listing of IdentityNode objects made after it
// (they are few). It lists no CiliumIdentity: on a crowded cluster that
// listing took seconds per run, during which nothing was deleted.
//
// A cache that lags costs no safety, because every reason to keep an
// identity that the cache could miss is written to the identity's object
// itself, and every write changes its resourceVersion, which the mark and
// the delete carry as precondition: an allocation that adopts a marked
// identity removes the mark; a walk that steps over a marked identity
// writes its step annotation before it creates an object further on; a
// Cilium agent removes the mark of what it uses. A mark or delete planned
// on a stale entry fails its precondition (Conflict, or NotFound for an
// object gone), is counted as skipped, and the next run decides again.
// The reasons that are not on the object are read after the cache:
// IdentityNode records and Cilium's endpoint objects (listed) and this
// node's own holds. The fence depends on other objects, the young ones
// after a free slot; the store assumes that a node's cache lags by less
// than maxCacheLag (docs/crd-store.md), so the cache shows every object
// created maxCacheLag before the run: an object whose walk saw a slot
// unmarked at its last look before the create (recheck) was created less
// than maxCacheLag after the slot's mark, and the mark is at least
// MinHeartbeatTimeout old when the slot is deleted, which leaves the
// object maxCacheLag to reach the cache before the run; one whose walk saw
// it marked recently (younger than stepNoteAge) is the same case, as the
// mark cannot reach the timeout before the object is in the cache; one
// whose walk saw an older mark announced the step, which defers the
// delete for gcStepWindow, by when the object is in the cache too.
//
// It runs only once the store's cache of identities has its first
// listing. The store's timer calls it while this
// node holds the collector's lock; a direct call collects whatever the
// lock says, and two collectors at once are safe.
//
// An identity that no live IdentityNode lists, that this node does not
// hold, that no CiliumEndpoint or CiliumEndpointSlice names and that no
// fence keeps gets the heartbeat mark; one marked at
// least HeartbeatTimeout before the run, and still unused and unfenced,
// is deleted with its UID and resourceVersion as preconditions, so that a
// node that removed the mark or changed the object in between wins.
// Deletions are paced by the rate limit. IdentityNode objects whose lease
// ended more than a lease ago are deleted, with their resourceVersion as
// precondition.
func (s *Store) collect(ctx context.Context) (res globalstore.GCResult, err error) {
	gc := s.gc
	gc.runs.Add(1)
	defer func() {
		if err != nil {
			gc.failed.Add(1)
		}
	}()
	if !s.ids.isSynced() {
		return res, fmt.Errorf("%w: the CiliumIdentity objects are not listed yet", globalstore.ErrUnavailable)
	}
	objs, nodes, in, err := s.gather(ctx)
	if err != nil {
		return res, err
	}

	// Decide, then act: what to mark, unmark and delete depends only on
	// the listings.
	var keptUsed, keptFenced int
	var marks, unmarks, deletes []*gcObject
	for i := range objs {
		o := &objs[i]
		d := in.decide(o)
		switch d.kept {
		case keptForUse:
			keptUsed++
		case keptByFence:
			keptFenced++
		}
		switch d.action {
		case gcMark:
			marks = append(marks, o)
		case gcUnmark:
			unmarks = append(unmarks, o)
		case gcDefer:
			res.Deferred++
		case gcDelete:
			deletes = append(deletes, o)
		}
	}

	// The marks and unmarks go in a loop of their own beside the paced
	// deletes, so that their requests do not take the deletes' turns:
	// the deletes keep the rate limit's pace however many marks a run
	// writes.
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		wg                 sync.WaitGroup
		marked, unmarked   int
		markErr, deleteErr error
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		marked, unmarked, markErr = s.gcWriteMarks(actx, marks, unmarks)
		if markErr != nil {
			cancel()
		}
	}()
	deleteErr = s.gcDelete(actx, deletes, &res)
	if deleteErr != nil {
		cancel()
	}
	wg.Wait()
	res.Marked, res.Unmarked = marked, unmarked
	switch {
	case markErr != nil:
		return res, markErr
	case deleteErr != nil:
		return res, deleteErr
	}
	res.KeptUsed, res.KeptFenced = keptUsed, keptFenced
	gc.keptUsed.Store(uint64(keptUsed))
	gc.keptFenced.Store(uint64(keptFenced))

	for i := range nodes {
		n := &nodes[i]
		if n.Name == s.node || !nodeGone(n, in.now) {
			continue
		}
		switch err := s.deleteNode(ctx, n); {
		case err == nil:
			res.NodesDeleted++
			gc.nodesDeleted.Add(1)
		case apierrors.IsConflict(err) || apierrors.IsNotFound(err):
			// Renewed or deleted meanwhile.
		default:
			return res, fmt.Errorf("%w: deleting IdentityNode %s: %w", globalstore.ErrUnavailable, n.Name, err)
		}
	}
	return res, nil
}

// gather reads the identities from the cache, then lists the IdentityNode
// records and Cilium's endpoint objects, and returns them with the inputs
// of the decisions on them, at the time of the cache's read. The listings
// come after the cache: an identity created since is not in objs, and one
// in objs that an endpoint took since was allocated by its agent, which
// removed the mark (and so changed the object under the delete's
// precondition).
func (s *Store) gather(ctx context.Context) ([]gcObject, []IdentityNode, *gcInputs, error) {
	now := s.gc.clock()
	objs := s.gcIdentities()
	nodes, err := s.listGCNodes(ctx)
	if err != nil {
		return nil, nil, nil, err
	}
	named, err := s.listEndpointIdentities(ctx)
	if err != nil {
		return nil, nil, nil, err
	}
	return objs, nodes, s.gcInputs(now, objs, nodes, named), nil
}

// gcInputs is what the collector's decision on one identity reads besides
// the identity's object: the uses that are not on the object, the fence
// and the clock.
type gcInputs struct {
	now time.Time
	// used holds the IDs live IdentityNode records list and this node
	// holds; named those Cilium's endpoint objects name.
	used, named map[identity.NumericIdentity]struct{}
	// fence holds the IDs the fence keeps (fenced).
	fence map[identity.NumericIdentity]bool
	// timeout is how old a mark must be for a delete (gcTimeout);
	// stepWindow how long a step annotation defers one.
	timeout, stepWindow time.Duration
	// ciliumAgents: Cilium agents share the store
	// (--identity-gc-cilium-agents), so a kept identity loses its mark.
	ciliumAgents bool
}

// gcInputs gathers the inputs of the decisions on objs: nodes and named
// must be listed after objs were read from the cache.
func (s *Store) gcInputs(now time.Time, objs []gcObject, nodes []IdentityNode, named map[identity.NumericIdentity]struct{}) *gcInputs {
	used := map[identity.NumericIdentity]struct{}{}
	for i := range nodes {
		n := &nodes[i]
		if n.Name != s.node && !nodeLive(n, now) {
			continue
		}
		for _, id := range n.Spec.Identities {
			used[identity.NumericIdentity(id)] = struct{}{}
		}
	}
	for _, id := range s.heldIDs() {
		used[identity.NumericIdentity(id)] = struct{}{}
	}
	return &gcInputs{
		now: now, used: used, named: named,
		fence:   fenced(s.ids.rng, objs, now.Add(-fenceWindow(s.gc.cfg))),
		timeout: s.gcTimeout(), stepWindow: s.gc.stepWindow,
		ciliumAgents: s.cfg.IdentityGCCiliumAgents,
	}
}

// gcAction is what the collector does to one identity.
type gcAction int

const (
	gcNone gcAction = iota
	gcMark
	gcUnmark
	// gcDefer: past its timeout, but a walk stepped over it less than
	// the step window ago.
	gcDefer
	gcDelete
)

// gcKept is why the collector keeps an identity, if it counts as kept.
type gcKept int

const (
	keptNot gcKept = iota
	keptForUse
	keptByFence
)

// gcDecision is the collector's decision on one identity.
type gcDecision struct {
	action gcAction
	kept   gcKept
}

// decide is the collector's rule for one identity, a function of the
// object and in alone: a use keeps it; an endpoint's name or the fence
// keeps it too, and take its mark where another collector could delete
// it; anything else is marked, and deleted once its mark is the timeout
// old, unless a walk announced a step over it within the step window.
func (in *gcInputs) decide(o *gcObject) gcDecision {
	if o.e == nil || o.id.IsReserved() {
		return gcDecision{}
	}
	if _, ok := in.used[o.id]; ok {
		return gcDecision{kept: keptForUse}
	}
	mark, marked := o.obj.Annotations[HeartbeatAnnotation]
	_, byEndpoint := in.named[o.id]
	if byEndpoint || in.fence[o.id] {
		d := gcDecision{kept: keptByFence}
		if byEndpoint {
			d.kept = keptForUse
		}
		if marked && (byEndpoint || in.ciliumAgents) {
			// Another collector (a Cilium operator) may delete a
			// marked identity; this one must stay while the fence
			// or the endpoint needs it. Without the mark, the
			// timeout starts again once nothing names it: an
			// agent that still holds it has a whole timeout to
			// remove the next mark. Where no Cilium runs, the
			// collectors are identityd's, which honour the fence:
			// a fenced identity keeps its mark, and its timeout
			// goes on while the fence lasts.
			d.action = gcUnmark
		}
		return d
	}
	at, err := time.Parse(time.RFC3339Nano, mark)
	switch {
	case !marked || err != nil:
		// Unmarked, or a mark this collector cannot date: marked
		// now, deleted a timeout later.
		return gcDecision{action: gcMark}
	case in.now.Sub(at) < in.timeout:
		return gcDecision{}
	case stepped(&o.obj, in.now.Add(-in.stepWindow)):
		// A walk stepped over it less than the step window ago and
		// may still create an object that depends on the slot and
		// that the cache does not show yet; a later run decides.
		return gcDecision{action: gcDefer}
	}
	return gcDecision{action: gcDelete}
}

// gcMarksInFlight bounds the marks and unmarks a run has sent and not
// seen answered. The rate limit does not pace them, but one at a time each
// waits for its answer: on an API server that answers a patch in 12 ms a
// run marks at most 80 identities a second, less than a churn the limit
// lets it delete, and a collector that cannot mark as fast as identities
// are released falls behind however fast it deletes. A run keeps as many
// marks in flight as deletes (deletesInFlight) where that is more: it
// marks what the limit lets it delete, on an API server as slow.
const gcMarksInFlight = 8

// gcWriteMarks removes the mark of the identities of unmarks and marks
// those of marks, up to max(gcMarksInFlight, deletesInFlight) requests at
// once, each with the resourceVersion the cache showed as precondition:
// an object changed since is left to the next run.
func (s *Store) gcWriteMarks(ctx context.Context, marks, unmarks []*gcObject) (marked, unmarked int, _ error) {
	gc := s.gc
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type write struct {
		o      *gcObject
		unmark bool
	}
	writes := make([]write, 0, len(unmarks)+len(marks))
	for _, o := range unmarks {
		writes = append(writes, write{o, true})
	}
	for _, o := range marks {
		writes = append(writes, write{o, false})
	}
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		next     atomic.Int64
		firstErr error
	)
	for range min(max(gcMarksInFlight, gc.deletesInFlight), len(writes)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				i := int(next.Add(1) - 1)
				if i >= len(writes) {
					return
				}
				w := writes[i]
				var err error
				if w.unmark {
					err = s.gcUnmark(ctx, w.o)
				} else {
					err = s.markForGC(ctx, w.o)
				}
				mu.Lock()
				switch {
				case err == nil && w.unmark:
					unmarked++
					gc.unmarked.Add(1)
				case err == nil:
					marked++
					gc.marked.Add(1)
				case apierrors.IsConflict(err) || apierrors.IsNotFound(err):
					// Changed since the listing: the next run looks again.
				case firstErr == nil && w.unmark:
					firstErr = fmt.Errorf("%w: removing the heartbeat mark of kept identity %d: %w", globalstore.ErrUnavailable, w.o.id, err)
					cancel()
				case firstErr == nil:
					firstErr = fmt.Errorf("%w: marking identity %d: %w", globalstore.ErrUnavailable, w.o.id, err)
					cancel()
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if firstErr == nil && ctx.Err() != nil {
		firstErr = ctx.Err()
	}
	return marked, unmarked, firstErr
}

// gcAnswerTime is the longest answer to a delete at which the collector
// still deletes at its rate limit: a loaded API server answered in 100 ms
// and more, and 8 deletes in flight then held 125 a second to about 60.
const gcAnswerTime = time.Second

// minDeletesInFlight is the fewest deletes in flight, whatever the limit.
const minDeletesInFlight = 8

// maxDeletesInFlight bounds the deletes in flight of a very high limit.
const maxDeletesInFlight = 512

// deletesInFlight is how many deletes may await their answers at once:
// the deletes the rate limit starts within gcAnswerTime, so that answers
// up to that slow do not lower the pace below the limit (Little's law:
// in flight = rate × answer time), between minDeletesInFlight and
// maxDeletesInFlight.
func (c GCConfig) deletesInFlight() int {
	perSecond := float64(c.RateLimit) / c.RateInterval.Seconds()
	n := math.Ceil(perSecond * gcAnswerTime.Seconds())
	return int(min(max(n, minDeletesInFlight), maxDeletesInFlight))
}

// gcStepWindow is how long a step annotation defers the delete of the
// identity it is on: the walk that wrote it creates its object within
// maxAnnounceAge, the collector's cache shows that object within
// maxCacheLag more, and the collector's clock may be stepClockMargin
// behind the walker's; from then on a node that walks the sequence sees
// the object in its last look before a create (recheck).
const gcStepWindow = maxAnnounceAge + maxCacheLag + stepClockMargin

// gcDelete deletes the identities of deletes, paced by the rate limit,
// each with its UID and listed resourceVersion as preconditions. The
// limit paces the starts; up to deletesInFlight wait for their answers
// at once.
func (s *Store) gcDelete(ctx context.Context, deletes []*gcObject, res *globalstore.GCResult) error {
	gc := s.gc
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		firstErr error
	)
	fail := func(err error) {
		mu.Lock()
		if firstErr == nil {
			firstErr = err
		}
		mu.Unlock()
		cancel()
	}
	sem := make(chan struct{}, gc.deletesInFlight)
	for _, o := range deletes {
		if err := gc.limiter.Wait(ctx); err != nil {
			fail(err)
			break
		}
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			fail(ctx.Err())
		}
		if ctx.Err() != nil {
			break
		}
		if gc.beforeDelete != nil {
			gc.beforeDelete(o)
		}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			err := s.deleteIdentity(ctx, o)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				res.Deleted++
				gc.deleted.Add(1)
			case apierrors.IsConflict(err) || apierrors.IsNotFound(err):
				res.Skipped++
				gc.skipped.Add(1)
			case firstErr == nil:
				firstErr = fmt.Errorf("%w: deleting identity %d: %w", globalstore.ErrUnavailable, o.id, err)
				cancel()
			}
		}()
	}
	wg.Wait()
	return firstErr
}

// nodeLease is a record's lease; a record that states none gets the
// shortest this store writes, so that it protects its identities a while
// and expires.
func nodeLease(n *IdentityNode) time.Duration {
	if n.Spec.LeaseDurationSeconds <= 0 {
		return MinIdentityNodeLeaseTTL
	}
	return time.Duration(n.Spec.LeaseDurationSeconds) * time.Second
}

// nodeLive reports whether n's uses count at now: its lease has not ended.
func nodeLive(n *IdentityNode, now time.Time) bool {
	return n.Spec.RenewTime.Add(nodeLease(n)).After(now)
}

// nodeGone reports whether n's lease ended more than a lease before now.
func nodeGone(n *IdentityNode, now time.Time) bool {
	return n.Spec.RenewTime.Add(2 * nodeLease(n)).Before(now)
}

// fenced returns the IDs the fence rule keeps: for a young object of
// label set M at position k > 0 of M's probe sequence, positions 0..k-1,
// when every one of them is held by an object now. (An object with a free
// slot before it is not where a walk of M's sequence finds M, as Cilium
// agents' random IDs are not; freeing more slots before it changes
// nothing for the walk.)
//
// The race a fence guards against: a node whose cache does not show M's
// object yet walks M's sequence, finds a slot before it free, and creates
// a second object of M there. An object is young when it may have been
// created after youngSince (creationTimestamp counts whole seconds, so one
// created in youngSince's second or later is young). The collection passes
// fenceWindow before its listing: a node creates only after a last look
// at its cache (recheck), which lags by at most maxCacheLag
// (docs/crd-store.md), so a node that creates after a delete sees every
// object created a window before the run, and walks again to M's object
// instead of creating. Only younger objects need their
// fences; an old object displaced far along a crowded range holds nothing,
// so a full range frees what its released identities held.
//
// Positions 0..k-1 of a sequence are the k IDs just before the object's
// own, cyclically in the range, so an object fences the last k IDs of the
// run of held IDs that ends at it; one backward sweep over the range finds
// them all.
func fenced(rng idRange, objs []gcObject, youngSince time.Time) map[identity.NumericIdentity]bool {
	lo := uint64(rng.lo)
	n := rng.size()
	held := make([]bool, n)
	reach := make([]uint64, n) // how many IDs before this one its object fences
	for i := range objs {
		held[uint64(objs[i].id)-lo] = true
	}
	// run[i]: held IDs just before offset i, cyclically (at most n-1).
	run := make([]uint64, n)
	for pass := 0; pass < 2; pass++ {
		for i := uint64(0); i < n; i++ {
			prev := (i + n - 1) % n
			if held[prev] {
				run[i] = min(run[prev]+1, n-1)
			} else {
				run[i] = 0
			}
		}
	}
	for i := range objs {
		o := &objs[i]
		if o.e == nil || !young(&o.obj, youngSince) {
			continue
		}
		k, ok := rng.probe(o.e.key).Position(o.id)
		if !ok || k == 0 {
			continue
		}
		off := uint64(o.id) - lo
		if run[off] >= k {
			reach[off] = max(reach[off], k)
		}
	}
	out := map[identity.NumericIdentity]bool{}
	// Backward, twice around, so that a run that wraps past the range's
	// end is covered: cover is how many IDs from here back are fenced.
	var cover uint64
	for step := 2*n - 1; ; step-- {
		i := step % n
		if cover > 0 && step < n {
			out[identity.NumericIdentity(lo+i)] = true
		}
		if cover > 0 {
			cover--
		}
		cover = max(cover, reach[i])
		if step == 0 {
			break
		}
	}
	return out
}

// stepped reports whether obj carries a step annotation written after
// since. One that does not parse is not identityd's and counts as none, so
// that it cannot keep an identity for ever.
func stepped(obj *CiliumIdentity, since time.Time) bool {
	at, err := time.Parse(time.RFC3339Nano, obj.Annotations[stepAnnotation])
	return err == nil && at.After(since)
}

// gcTimeout is how long a mark must be old before its identity is
// deleted. Beside Cilium agents it is the heartbeat timeout: an agent
// records no use, and removes a mark only at its periodic sync. Without
// them (--identity-gc-cilium-agents=false) every use is in an IdentityNode
// record, which the collector reads, and the mark only has to outlast the
// walks and caches the fence assumes: the grace is half a collection
// interval, at least MinHeartbeatTimeout and at most the heartbeat
// timeout, so that an identity marked in one run is deleted in the next
// one (its mark is written after the run's start, so a whole interval
// would often wait for a third run).
func (s *Store) gcTimeout() time.Duration {
	gc := s.gc
	if s.cfg.IdentityGCCiliumAgents || gc.cfg.Interval <= 0 {
		return gc.cfg.HeartbeatTimeout
	}
	return min(gc.cfg.HeartbeatTimeout, max(gc.cfg.Interval/2, gc.minGrace))
}

// fenceWindow is how long after its creation an object fences the slots
// before it: the lag of a node's cache, which the store assumes under
// maxCacheLag (docs/crd-store.md), and the margin between the API
// server's clock, which stamps the creation, and the collector's; or the
// heartbeat timeout where that is shorter (tests).
func fenceWindow(c GCConfig) time.Duration {
	return min(c.HeartbeatTimeout, maxCacheLag+stepClockMargin)
}

// young reports whether obj may have been created after since: the API
// server keeps creationTimestamp in whole seconds, so an object stamped
// with since's second, or a later one, is young.
func young(obj *CiliumIdentity, since time.Time) bool {
	return obj.CreationTimestamp.Add(time.Second).After(since)
}

// gcIdentities returns the CiliumIdentity objects of this cluster's range
// that the store's cache shows, by ID: those whose labels do not parse
// without their object, as they only hold their IDs.
func (s *Store) gcIdentities() []gcObject {
	es, unparsed := s.ids.snapshot()
	out := make([]gcObject, 0, len(es)+len(unparsed))
	for _, e := range es {
		if e.obj == nil {
			// No object to write preconditions from: it holds its
			// ID, and nothing is written to it.
			out = append(out, gcObject{id: e.id})
			continue
		}
		out = append(out, gcObject{id: e.id, e: e, obj: *e.obj})
	}
	for _, id := range unparsed {
		out = append(out, gcObject{id: id})
	}
	slices.SortFunc(out, func(a, b gcObject) int { return cmp.Compare(a.id, b.id) })
	return out
}

// listGCNodes lists the IdentityNode objects, in pages of gcListPageSize:
// the first page without a resourceVersion (a consistent read), the next
// ones from the same snapshot.
func (s *Store) listGCNodes(ctx context.Context) ([]IdentityNode, error) {
	var out []IdentityNode
	opts := metav1.ListOptions{Limit: gcListPageSize}
	for {
		var list IdentityNodeList
		err := s.nodeClient.Get().Resource("identitynodes").VersionedParams(&opts, metav1.ParameterCodec).Do(ctx).Into(&list)
		if apierrors.IsResourceExpired(err) && opts.Continue != "" {
			out, opts = nil, metav1.ListOptions{Limit: gcListPageSize}
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("%w: listing IdentityNode objects: %w", globalstore.ErrUnavailable, err)
		}
		out = append(out, list.Items...)
		if list.Continue == "" {
			return out, nil
		}
		opts.Continue = list.Continue
	}
}

// markForGC sets the heartbeat mark (the time, RFC 3339 with nanoseconds,
// as Cilium's operator writes it) on o's object, if its resourceVersion is
// still the listed one. The time is the write's, not the run's: the
// timeout counts from when the mark can be seen.
func (s *Store) markForGC(ctx context.Context, o *gcObject) error {
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{
		"resourceVersion": o.obj.ResourceVersion,
		"annotations":     map[string]string{HeartbeatAnnotation: s.gc.clock().UTC().Format(time.RFC3339Nano)},
	}})
	if err != nil {
		return err
	}
	_, err = patchMetadataOnly(ctx, s.ciliumClient, "ciliumidentities", o.obj.Name, patch)
	return err
}

// gcUnmark removes the heartbeat mark of o's object, if its
// resourceVersion is still the listed one.
func (s *Store) gcUnmark(ctx context.Context, o *gcObject) error {
	patch := fmt.Appendf(nil, `{"metadata":{"resourceVersion":%q,"annotations":{%q:null}}}`, o.obj.ResourceVersion, HeartbeatAnnotation)
	_, err := patchMetadataOnly(ctx, s.ciliumClient, "ciliumidentities", o.obj.Name, patch)
	return err
}

// deleteIdentity deletes o's object if its UID and resourceVersion are
// still the listed ones.
func (s *Store) deleteIdentity(ctx context.Context, o *gcObject) error {
	body, err := preconditions(o.obj.UID, o.obj.ResourceVersion)
	if err != nil {
		return err
	}
	return s.ciliumClient.Delete().Resource("ciliumidentities").Name(o.obj.Name).Body(body).Do(ctx).Error()
}

// deleteNode deletes n if its UID and resourceVersion are still the
// listed ones: a renewal in between keeps it.
func (s *Store) deleteNode(ctx context.Context, n *IdentityNode) error {
	body, err := preconditions(n.UID, n.ResourceVersion)
	if err != nil {
		return err
	}
	return s.nodeClient.Delete().Resource("identitynodes").Name(n.Name).Body(body).Do(ctx).Error()
}

func preconditions(uid types.UID, rv string) ([]byte, error) {
	return json.Marshal(&metav1.DeleteOptions{
		TypeMeta:      metav1.TypeMeta{APIVersion: "v1", Kind: "DeleteOptions"},
		Preconditions: &metav1.Preconditions{UID: &uid, ResourceVersion: &rv},
	})
}

// Values of the status label of identityd_crd_identity_gc_entries, and of
// the reason label of identityd_crd_identity_gc_kept.
const (
	gcStatusMarked   = "marked"
	gcStatusSkipped  = "skipped"
	gcStatusUnmarked = "unmarked"
	// gcStatusReclaimed counts the deletes of walks that took the slot
	// (reclaim), which no collection run made.
	gcStatusReclaimed = "reclaimed"
	gcKeptUsed        = "used"
	gcKeptFenced      = "fenced"
	labelReason       = "reason"
)

// newGCMetrics contributes the collector's metrics, when the hive's
// backend is this store.
func newGCMetrics(b globalstore.Backend) metrics.CollectorOut {
	s, ok := b.(*Store)
	if !ok || s == nil {
		return metrics.CollectorOut{}
	}
	return metrics.NewCollector(newGCCollector(s))
}

// newGCCollector reads the collector's counters at scrape time. Its names
// are those of the etcd store's collection with crd_ in front; like them,
// entries and runs are gauges holding totals since the agent started.
func newGCCollector(s *Store) *metrics.ScrapeCollector {
	var (
		entries = metrics.NewDesc("crd_identity_gc_entries",
			"Number of CiliumIdentity objects the garbage collection marked, deleted, skipped (a precondition refused the delete: a use won), unmarked (fenced) or reclaimed (deleted by an allocation to take its ID) since the agent started, by status",
			metrics.LabelStatus)
		runs = metrics.NewDesc("crd_identity_gc_runs",
			"Number of CRD identity garbage collection runs since the agent started, by outcome (a run in progress counts as success)",
			metrics.LabelOutcome)
		kept = metrics.NewDesc("crd_identity_gc_kept",
			"Number of CiliumIdentity objects the last garbage collection run kept, by reason: used (a live IdentityNode lists it, or a CiliumEndpoint or CiliumEndpointSlice names it) or fenced (a later identity's probe sequence needs it)",
			labelReason)
		nodes = metrics.NewDesc("crd_identity_gc_nodes_deleted_total",
			"Number of IdentityNode objects the garbage collection deleted a lease after their lease ended")
		leader = metrics.NewDesc("crd_identity_gc_leader",
			"1 while this node holds the cluster's IdentityLease of the garbage collection and collects, else 0")
	)
	return metrics.NewScrapeCollector(func(m metrics.Scrape) {
		gc := s.gc
		m.Gauge(entries, float64(gc.marked.Load()), gcStatusMarked)
		m.Gauge(entries, float64(gc.deleted.Load()), metrics.GCStatusDeleted)
		m.Gauge(entries, float64(gc.skipped.Load()), gcStatusSkipped)
		m.Gauge(entries, float64(gc.unmarked.Load()), gcStatusUnmarked)
		m.Gauge(entries, float64(gc.reclaimed.Load()), gcStatusReclaimed)
		// failed is read first, so that the difference is never negative.
		failed := gc.failed.Load()
		m.Gauge(runs, float64(gc.runs.Load()-failed), metrics.OutcomeSuccess)
		m.Gauge(runs, float64(failed), metrics.OutcomeFailure)
		m.Gauge(kept, float64(gc.keptUsed.Load()), gcKeptUsed)
		m.Gauge(kept, float64(gc.keptFenced.Load()), gcKeptFenced)
		m.Counter(nodes, float64(gc.nodesDeleted.Load()))
		lead := 0.0
		if _, self := s.GCLeader(); self {
			lead = 1
		}
		m.Gauge(leader, lead)
	}, entries, runs, kept, nodes, leader)
}
