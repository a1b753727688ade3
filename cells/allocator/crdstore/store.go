package crdstore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/identityd/identityd/internal/idprobe"
	"github.com/identityd/identityd/internal/retry"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/go-logr/logr"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8slabels "k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// Bounds of one allocation. Each conflict is another writer's progress (a
// slot taken by another label set, an object changed under an update), so
// a run of them means something is wrong; transient errors get room for an
// API server restart.
const (
	maxConflicts = 32
	maxTransient = 12
	// maxWalkAge bounds the time from a walk's first look at the cache to
	// its create, so that what a walk decides, and the listings a
	// reclaiming walk shares (reclaimInputs), are recent. An older walk
	// starts again. Safety rests on the last look before the create
	// (recheck), not on this bound.
	maxWalkAge = time.Minute
	// cacheWait is how long an AlreadyExists waits for the watch to
	// deliver the object before it reads it with a request.
	cacheWait = 50 * time.Millisecond
	// settleWait bounds the wait for the watch to deliver the object an
	// allocation found or created, before the allocation lists the label
	// set's objects instead.
	settleWait = time.Second
	// listPage is the page size of the label set's listing.
	listPage = 500
)

// Store is the globalstore.Backend that keeps global identities as Cilium's
// CiliumIdentity objects in a Kubernetes API server, and this node's uses
// in its IdentityNode object. A new label set costs one create in the
// common case; a label set in the cache none.
type Store struct {
	log     *slog.Logger
	cfg     Config
	rest    *rest.Config
	cluster identity.ClusterInfo
	node    string
	// claim names this process in its IdentityNode (spec.holder).
	claim globalstore.NodeClaim
	// startRecord is what the start read of the IdentityNode, for the
	// writer.
	startRecord ownRecord
	// contention orders the creates of nodes that race on the same
	// label sets (contention.go).
	contention contention

	ciliumClient *rest.RESTClient
	nodeClient   *rest.RESTClient
	// sliceClient reads Cilium's v2alpha1 CiliumEndpointSlice objects,
	// for the garbage collection.
	sliceClient *rest.RESTClient

	ids *identityCache
	// adoptOnly: this node writes no CiliumIdentity (globalstore.AdoptOnly).
	adoptOnly bool

	events globalstore.Events
	refs   globalstore.References

	// writer is this node's IdentityNode writer; unmarks queues held
	// identities that got the heartbeat mark.
	writer  nodeWriter
	unmarks unmarkQueue
	// splits wakes the identity-splits job (splits.go).
	splits splitWatch

	stats allocStats

	// stopped is set when the store's hooks stop: releases write
	// nothing from then on.
	stopped atomic.Bool
	// health scopes, set by the cell (nil outside a hive).
	health cell.Health

	// gc is the garbage collection's configuration and counters;
	// election this node's side of the election of the one node that
	// collects (nil before its job starts, and without collection).
	gc       *gcState
	election atomic.Pointer[gcElection]
	// reclaimInputs is the last decision inputs a walk gathered to
	// reclaim, which walks that looked before it share (reclaimInputs).
	reclaimInputs reclaimInputs
	// pending are this node's walks' creates, which its other walks
	// wait for rather than race (pendingSlots).
	pending pendingSlots
	// predecessor is the holder identity, in the election, of the gone
	// agent of this node name whose IdentityNode this one took over at
	// start (nil when none): a lock it still holds is this node's to take.
	predecessor atomic.Pointer[string]
	// electionTimings, when set (by tests), replaces the election's
	// timings derived from the IdentityNode lease.
	electionTimings electionTimings

	// restSource gives the store its API server's settings at start,
	// when it has none yet; listTimeout bounds the wait for the first
	// listing there.
	restSource  func() *rest.Config
	listTimeout time.Duration
}

var _ globalstore.Backend = (*Store)(nil)

// allocStats counts allocations by outcome.
type allocStats struct {
	created, adopted, conflict, exhausted, failed atomic.Uint64
	unmarked, reads, taken                        atomic.Uint64
	// listings counts listings of a label set's objects; repicked the
	// allocations that used another object than the one first found.
	listings, repicked atomic.Uint64
}

// newUnconnected returns the store of the cluster's ID range, recording
// this node's uses under the name node and reporting to sink, without the
// clients, which connect builds.
func newUnconnected(log *slog.Logger, cluster identity.ClusterInfo, node identity.NodeName, c Config, sink *globalstore.Sink) (*Store, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	if node == "" {
		return nil, errors.New("the CRD store needs a node name (--node-name)")
	}
	s := &Store{
		log:     log,
		cfg:     c,
		cluster: cluster,
		node:    string(node),
		claim:   globalstore.NewNodeClaim(),
		events:  sink,
		refs:    sink,
		writer:  newNodeWriter(),
		unmarks: newUnmarkQueue(),
		splits:  newSplitWatch(),
		gc:      newGCState(DefaultGCConfig),
	}
	s.ids = newIdentityCache(log, cluster, cacheHooks{
		emit:   s.emit,
		marked: s.markSeen,
		synced: func() { s.events.Synced() },
		split:  s.splits.signal,
	})
	return s, nil
}

// connect builds the store's clients of the API server of cfg: when the
// store is built with a config, or at its start with the Kubernetes
// client's.
func (s *Store) connect(cfg *rest.Config) error {
	codecs := newCodecs()
	cilium, err := restClient(cfg, schema.GroupVersion{Group: CiliumGroup, Version: CiliumVersion}, codecs)
	if err != nil {
		return err
	}
	own, err := restClient(cfg, schema.GroupVersion{Group: IdentityGroup, Version: IdentityVersion}, codecs)
	if err != nil {
		return err
	}
	ces, err := restClient(cfg, schema.GroupVersion{Group: CiliumGroup, Version: CiliumSliceVersion}, codecs)
	if err != nil {
		return err
	}
	s.rest, s.ciliumClient, s.nodeClient, s.sliceClient = cfg, cilium, own, ces
	return nil
}

func restClient(cfg *rest.Config, gv schema.GroupVersion, codecs interface {
	WithoutConversion() runtime.NegotiatedSerializer
}) (*rest.RESTClient, error) {
	c := rest.CopyConfig(cfg)
	c.GroupVersion = &gv
	c.APIPath = "/apis"
	c.NegotiatedSerializer = codecs.WithoutConversion()
	c.ContentType = runtime.ContentTypeJSON
	if c.UserAgent == "" {
		c.UserAgent = rest.DefaultKubernetesUserAgent()
	}
	cli, err := rest.RESTClientFor(c)
	if err != nil {
		return nil, fmt.Errorf("building the client of %s: %w", gv, err)
	}
	return cli, nil
}

// register makes the store an ordinary part of the hive. A hook connects
// (with the Kubernetes client, whose settings exist once its start hook
// ran), registers the CRDs when they are missing or outdated and claims
// the node's IdentityNode; then come the loops, as jobs of g: the watch of
// CiliumIdentity objects, the IdentityNode writer and its renewal, and the
// garbage collection's election and timer; last a hook waits for the first
// listing of identities, at most --allocator-list-timeout (the listing
// continues in the background after it). Hooks stop in the reverse order,
// so the loops end before the store counts as stopped. No node watches the
// IdentityNode objects of others: only the collector reads them, when it
// runs.
func (s *Store) register(lc cell.Lifecycle, g job.Group) {
	lc.Append(cell.Hook{OnStart: s.claimAtStart, OnStop: func(cell.HookContext) error {
		s.stopped.Store(true)
		s.claim.Forget()
		return nil
	}})
	g.Add(job.OneShot("global-identities-watch", func(ctx context.Context, h cell.Health) error {
		s.runReflector(ctx, h, "ciliumidentities", &CiliumIdentity{}, s.ids, s.ciliumClient,
			func() runtime.Object { return &CiliumIdentityList{} })
		return nil
	}))
	g.Add(oneShot("identity-node-writer", s.writeLoop))
	g.Add(oneShot("identity-node-watch", s.watchOwnRecord))
	g.Add(oneShot("identity-unmark", s.unmarkLoop))
	g.Add(oneShot("identity-splits", s.splitLoop))
	g.Add(job.Timer("identity-node-renew", func(context.Context) error {
		return s.renewTick()
	}, s.cfg.IdentityNodeLeaseTTL/3))
	s.registerGC(g)
	lc.Append(cell.Hook{OnStart: s.waitListed})
}

// claimAtStart connects when the store has no clients yet, registers the
// CRDs and claims this node's IdentityNode; the writer's first write
// rewrites the record from the allocator's references, and renews it.
func (s *Store) claimAtStart(ctx cell.HookContext) error {
	if s.ciliumClient == nil {
		cfg := s.restSource()
		if cfg == nil {
			return errors.New("crd mode: the Kubernetes client has no connection settings (its start did not succeed)")
		}
		if err := s.connect(cfg); err != nil {
			return err
		}
	}
	if err := RegisterCRDs(ctx, s.rest); err != nil {
		return err
	}
	if err := s.claimNodeName(ctx); err != nil {
		return err
	}
	s.writer.request(true)
	return nil
}

// waitListed waits for the first listing of identities, at most the list
// timeout.
func (s *Store) waitListed(ctx cell.HookContext) error {
	var timeout <-chan time.Time
	if s.listTimeout > 0 {
		t := time.NewTimer(s.listTimeout)
		defer t.Stop()
		timeout = t.C
	}
	select {
	case <-s.ids.synced:
	case <-timeout:
		s.log.Warn("CiliumIdentity objects not listed within --allocator-list-timeout; listing continues in the background", "timeout", s.listTimeout)
	case <-ctx.Done():
		s.log.Warn("Start ended before the CiliumIdentity objects were listed; listing continues in the background", "error", ctx.Err())
	}
	return nil
}

// oneShot returns a job running loop until the hive stops it.
func oneShot(name string, loop func(context.Context, cell.Health)) job.Job {
	return job.OneShot(name, func(ctx context.Context, h cell.Health) error {
		loop(ctx, h)
		return nil
	})
}

// runReflector keeps store in step with the API server's objects of
// resource: client-go's Reflector lists, watches from the listing's
// resourceVersion and lists again after a 410 Gone or a broken watch. Its
// failures go to health, its log to the store's logger.
func (s *Store) runReflector(ctx context.Context, h cell.Health, resource string, expected runtime.Object, store cache.ReflectorStore, cli *rest.RESTClient, newList func() runtime.Object) {
	var (
		broken, probing atomic.Bool
		probes          sync.WaitGroup
	)
	defer probes.Wait()
	fail := func(what string, err error) {
		if ctx.Err() != nil {
			return
		}
		broken.Store(true)
		if h != nil {
			// The API server failed or is unreachable: readiness,
			// not liveness (a restart would not bring it back).
			h.Degraded(what+" of "+resource+" failed", health.External(err))
			if probing.CompareAndSwap(false, true) {
				probes.Go(func() {
					defer probing.Store(false)
					probeUntilAnswered(ctx, cli, &broken, func() {
						h.OK("API server answers again; the " + resource + " watch resumes after its backoff")
					})
				})
			}
		}
	}
	ok := func(what string) {
		if h != nil && (broken.Swap(false) || what == "listed") {
			h.OK(resource + " " + what)
		}
	}
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
			out := newList()
			err := cli.Get().Resource(resource).VersionedParams(&opts, metav1.ParameterCodec).Do(ctx).Into(out)
			if err != nil {
				fail("Listing", err)
				return nil, err
			}
			return out, nil
		},
		WatchFuncWithContext: func(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
			opts.Watch = true
			w, err := cli.Get().Resource(resource).VersionedParams(&opts, metav1.ParameterCodec).Watch(ctx)
			if err != nil {
				fail("Watching", err)
				return nil, err
			}
			ok("watched")
			return w, nil
		},
	}
	logger := logr.FromSlogHandler(s.log.Handler())
	r := cache.NewReflectorWithOptions(lw, expected, &reportingStore{ReflectorStore: store, listed: func() { ok("listed") }},
		cache.ReflectorOptions{Name: resource, Logger: &logger})
	r.RunWithContext(ctx)
}

// reachabilityProbe is the pace at which probeUntilAnswered asks.
const reachabilityProbe = time.Second

// probeUntilAnswered asks the API server for /version every second while
// broken is set, and calls answered at its first answer. The reflector
// retries its listing with a backoff that grows to 30 s, jittered up to
// twice that, and spread over
// the nodes, so that an API server that comes back is not listed by all of
// them at once; readiness, which says whether this node can allocate, must
// not wait for it.
func probeUntilAnswered(ctx context.Context, cli *rest.RESTClient, broken *atomic.Bool, answered func()) {
	t := time.NewTicker(reachabilityProbe)
	defer t.Stop()
	for broken.Load() {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		pctx, cancel := context.WithTimeout(ctx, reachabilityProbe)
		err := cli.Get().AbsPath("/version").Do(pctx).Error()
		cancel()
		if err == nil {
			if broken.Load() {
				answered()
			}
			return
		}
	}
}

// reportingStore tells health when a listing completed.
type reportingStore struct {
	cache.ReflectorStore
	listed func()
}

func (r *reportingStore) Replace(list []any, rv string) error {
	err := r.ReflectorStore.Replace(list, rv)
	if err == nil {
		r.listed()
	}
	return err
}

func (r *reportingStore) Bookmark(rv string) error {
	if b, ok := r.ReflectorStore.(cache.ReflectorBookmarkStore); ok {
		return b.Bookmark(rv)
	}
	return nil
}

// emit reports the cache's changes to the allocator, and queues the
// re-creation of deleted identities this node still uses.
func (s *Store) emit(changes []change) {
	for _, c := range changes {
		if c.upsert {
			s.events.Upsert(c.id, c.lbls)
			continue
		}
		s.events.Delete(c.id, c.lbls)
		// Whatever label set the object held: an object of another one
		// under an ID this node uses (the ID was taken) leaves room to
		// re-create this node's own.
		if !s.stopped.Load() && s.refs != nil && s.refs.ByID(c.id) != nil {
			s.unmarks.lost(c.id)
		}
	}
}

// LookupByID implements globalstore.Backend from the cache.
func (s *Store) LookupByID(id identity.NumericIdentity) (labels.Labels, bool) {
	if e := s.ids.get(id); e != nil {
		return e.lbls, true
	}
	return nil, false
}

// LookupByLabels implements globalstore.Backend from the cache, by the
// design's rule (see identityCache.lookup).
func (s *Store) LookupByLabels(lbls labels.Labels) (identity.NumericIdentity, bool) {
	if e := s.ids.lookup(lbls.Canonical()); e != nil {
		return e.id, true
	}
	return 0, false
}

// Allocate implements globalstore.Backend. A label set the cache knows is
// adopted (no request unless it carries the heartbeat mark). Otherwise the
// walk of its probe sequence skips the IDs the cache shows held by other
// label sets (leaving their marks, and announcing the steps over marked
// ones before it creates), and creates the first free one;
// AlreadyExists means the cache was behind: the object (from the cache once
// it arrives, else one read) is adopted if it holds the label set, skipped
// otherwise.
func (s *Store) Allocate(ctx context.Context, lbls labels.Labels, record func(*globalstore.Reference)) (identity.NumericIdentity, bool, error) {
	if s.adoptOnly {
		id, err := s.Adopt(ctx, lbls, record)
		if err != nil {
			err = fmt.Errorf("%w (this node is in operator mode: the identity manager creates global identities)", err)
		}
		return id, false, err
	}
	key := lbls.Canonical()
	id, created, err := s.allocate(ctx, key, lbls)
	if err != nil {
		switch {
		case errors.Is(err, globalstore.ErrSpaceExhausted):
			s.stats.exhausted.Add(1)
		case errors.Is(err, globalstore.ErrConflict):
			s.stats.conflict.Add(1)
		default:
			s.stats.failed.Add(1)
		}
		return 0, false, fmt.Errorf("allocating global identity for %s: %w", key, err)
	}
	if created {
		s.stats.created.Add(1)
	} else {
		s.stats.adopted.Add(1)
	}
	record(globalstore.NewReference(id, lbls, 0))
	s.writer.request(false)
	// The rule's pick may have moved between the answer and the
	// record, after the identity-splits job last looked.
	s.splits.signalIfHeld(s.ids, key, id)
	return id, created, nil
}

// Adopt implements globalstore.Backend: the rule's pick among the label
// set's objects the cache shows, settled as an allocation settles it and
// with its heartbeat mark removed; never a create. On a node given
// globalstore.AdoptOnly a marked pick is not adopted (ErrNoIdentity): its
// writer removes the mark when it takes the label set up again, and
// Allocate adopts too.
func (s *Store) Adopt(ctx context.Context, lbls labels.Labels, record func(*globalstore.Reference)) (identity.NumericIdentity, error) {
	key := lbls.Canonical()
	a := &allocation{s: s, key: key, lbls: lbls}
	for {
		e := s.ids.lookup(key)
		if e == nil {
			return 0, fmt.Errorf("adopting global identity for %s: %w", key, globalstore.ErrNoIdentity)
		}
		pick, err := a.settle(ctx, e.id)
		if err == nil && s.adoptOnly && pick.marked() {
			// Its writer removes the mark when it takes the
			// label set up again; until then the collector may
			// delete it.
			return 0, fmt.Errorf("adopting global identity for %s: %w: its CiliumIdentity %d carries the heartbeat mark of an unused identity", key, globalstore.ErrNoIdentity, pick.id)
		}
		if err == nil {
			err = a.adopt(ctx, pick)
		}
		if errors.Is(err, errRestart) {
			continue
		}
		if err != nil {
			s.stats.failed.Add(1)
			return 0, fmt.Errorf("adopting global identity for %s: %w", key, err)
		}
		s.stats.adopted.Add(1)
		record(globalstore.NewReference(pick.id, lbls, 0))
		s.writer.request(false)
		s.splits.signalIfHeld(s.ids, key, pick.id)
		return pick.id, nil
	}
}

// allocation is the state of one Allocate.
type allocation struct {
	s                     *Store
	key                   string
	lbls                  labels.Labels
	conflicts, transients int
	// waited: the allocation has waited once for nodes that rank
	// before this one (contention.go).
	waited bool
	// readOnly: the walk reads the slots the cache shows free instead of
	// creating there, since an object created now could not win against
	// the cache's pick (find).
	readOnly bool
	// adopted is the ID whose object find adopted (its mark removed).
	adopted identity.NumericIdentity
	// seq is the label set's probe sequence.
	seq idprobe.Sequence
	// walkStart is when the current walk first looked at the cache;
	// stepped holds the marked objects of other label sets it stepped
	// over, which the walk may reclaim; announced the IDs it wrote its
	// step annotation on (recheck), the first at firstAnnounce.
	walkStart     time.Time
	stepped       []*entry
	announced     map[identity.NumericIdentity]bool
	firstAnnounce time.Time
	// refreshed holds the objects an announcement met changed (another
	// walk announced first), as a read found them; refreshes counts the
	// reads of this walk.
	refreshed map[identity.NumericIdentity]*entry
	refreshes int
	// reclaimWaitUntil ends the allocation's wait for identities the
	// collector is going to delete (waitToReclaim); zero before its
	// first wait.
	reclaimWaitUntil time.Time
	// claimed is the slot a reclaim claimed (pendingSlots) before it
	// deleted the identity there, for the create that follows.
	claimed *pendingSlot
}

// retry counts a failed request and waits before the next, or returns the
// error that ends the allocation.
func (a *allocation) retry(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("%w: %w", globalstore.ErrUnavailable, ctx.Err())
	}
	if !transient(err) {
		return fmt.Errorf("%w: %w", globalstore.ErrUnavailable, err)
	}
	if a.transients++; a.transients > maxTransient {
		return fmt.Errorf("%w: after %d attempts: %w", globalstore.ErrUnavailable, a.transients, err)
	}
	a.s.log.Debug("Retrying global identity allocation", "labels", a.key, "error", err)
	retry.Sleep(ctx, retry.Backoff(a.transients))
	return nil
}

// conflict counts another writer's win, or ends the allocation.
func (a *allocation) conflict() error {
	if a.conflicts++; a.conflicts > maxConflicts {
		return fmt.Errorf("%w: after %d conflicts", globalstore.ErrConflict, a.conflicts)
	}
	return nil
}

// errRestart makes the allocation look the label set up again and walk
// from the start.
var errRestart = errors.New("walk again")

// allocate finds the label set's object (find), then makes sure it is the
// one the rule picks among all of the label set's objects (settle): a node
// whose cache was behind may have found or created another.
func (s *Store) allocate(ctx context.Context, key string, lbls labels.Labels) (identity.NumericIdentity, bool, error) {
	p := s.ids.rng.probe(key)
	a := &allocation{s: s, key: key, lbls: lbls, seq: p, announced: map[identity.NumericIdentity]bool{}, refreshed: map[identity.NumericIdentity]*entry{}}
	for {
		a.adopted = 0
		id, created, err := a.find(ctx, p)
		if err != nil {
			return 0, false, err
		}
		pick, err := a.settle(ctx, id)
		if err == nil && pick.id != id && created {
			// Left to the garbage collection: no node that
			// follows the rule uses it.
			s.log.Info("Created a CiliumIdentity for a label set whose older object the rule picks; using the older",
				"labels", key, "created", id, "used", pick.id)
		}
		if err == nil && pick.id == id && (created || a.adopted == id) {
			return id, created, nil
		}
		if err == nil {
			// Not adopted yet: an object the walk did not find, or
			// one settle had to list.
			if err = a.adopt(ctx, pick); err == nil {
				if pick.id != id {
					s.stats.repicked.Add(1)
				}
				return pick.id, false, nil
			}
		}
		if !errors.Is(err, errRestart) {
			return 0, false, err
		}
	}
}

// settle returns the object the rule picks for the label set, given id,
// the object the walk of its probe sequence found or created for it (the
// walk's first object of the set, which every node's walk reaches). Once
// the cache shows that object it shows every object that became visible
// before it, and one that becomes visible after was created too late to
// win against it (walkHeadStart): the cache decides, without a request.
// A watch more than settleWait behind leaves it to a listing (listed).
func (a *allocation) settle(ctx context.Context, id identity.NumericIdentity) (*entry, error) {
	s := a.s
	if e := s.ids.waitFor(ctx, id, settleWait); e != nil && e.key == a.key {
		if pick := s.ids.lookup(a.key); pick != nil {
			return pick, nil
		}
	}
	return a.listed(ctx)
}

// listed returns the rule's pick among the label set's objects as the API
// server has them now: a consistent listing, selected by the object labels
// every writer of the set puts on its objects. errRestart: the label set
// has no object any more.
func (a *allocation) listed(ctx context.Context) (*entry, error) {
	for {
		es, err := a.listObjects(ctx)
		if err != nil {
			if err := a.retry(ctx, err); err != nil {
				return nil, err
			}
			continue
		}
		pick := a.s.ids.pickListed(a.key, es)
		if pick == nil {
			if err := a.conflict(); err != nil {
				return nil, err
			}
			return nil, errRestart
		}
		return pick, nil
	}
}

// listObjects lists the objects of the label set: those whose object
// labels include the set's (a Cilium agent writes at least these), in
// pages, without a resourceVersion, so that the answer is a consistent
// read of the API server's current state.
func (a *allocation) listObjects(ctx context.Context) ([]*entry, error) {
	s := a.s
	s.stats.listings.Add(1)
	sel, _ := objectLabels(a.lbls)
	opts := metav1.ListOptions{LabelSelector: k8slabels.SelectorFromSet(sel).String(), Limit: listPage}
	var out []*entry
	for {
		var list CiliumIdentityList
		if err := s.ciliumClient.Get().Resource("ciliumidentities").VersionedParams(&opts, metav1.ParameterCodec).Do(ctx).Into(&list); err != nil {
			return nil, err
		}
		for i := range list.Items {
			if e, err := s.ids.parse(&list.Items[i]); err == nil && e.key == a.key {
				out = append(out, e)
			}
		}
		if list.Continue == "" {
			return out, nil
		}
		opts.Continue = list.Continue
	}
}

// find returns the object of the label set the cache picks when nothing
// the cache does not show yet can overturn the pick (pickSettled), else the
// one the walk of its probe sequence finds or creates: a young object off
// the sequence is never adopted on the cache's word alone, since the
// sequence's object, stamped in the same moment, may reach this node later
// and win. Where an object created now could not win against the cache's
// pick, or the pick is an object identityd created, the walk only reads
// the slot the cache shows free: one request, and no object that no node
// would use.
func (a *allocation) find(ctx context.Context, p idprobe.Sequence) (identity.NumericIdentity, bool, error) {
	s := a.s
	key := a.key
	for {
		now := time.Now()
		e, settled := s.ids.pickSettled(key, now)
		if !settled {
			// An object identityd created (at etcd's ID, in a
			// migration) is adopted as the walk's own would be: the
			// head start is for other writers' objects.
			a.readOnly = e != nil && (e.placed || s.ids.outranksNew(e, now))
			id, created, err := a.walk(ctx, p)
			a.readOnly = false
			if errors.Is(err, errRestart) {
				continue
			}
			if !errors.Is(err, errNoSequenceObject) {
				return id, created, err
			}
			// No object of the set on its sequence: the cache's
			// pick stands.
		}
		err := a.adopt(ctx, e)
		if err == nil {
			a.adopted = e.id
			return e.id, false, nil
		}
		if !errors.Is(err, errRestart) {
			return 0, false, err
		}
		// The object changed under the update, or is gone; the cache
		// may not show it yet: settle its slot from a read.
		fresh, err := a.read(ctx, e.id)
		if err != nil {
			return 0, false, err
		}
		if fresh != nil {
			// Adopt it as it is now, or skip it if another label
			// set holds the ID.
			done, created, err := a.trySlot(ctx, e.id, fresh)
			if err != nil || done {
				return e.id, created, err
			}
		}
		// Gone (a new object goes where the walk places it, not where
		// the old one was), or another label set's: walk.
		id, created, err := a.walk(ctx, p)
		if errors.Is(err, errRestart) {
			continue
		}
		return id, created, err
	}
}

// errNoSequenceObject: a read-only walk found a free slot before any object
// of the label set.
var errNoSequenceObject = errors.New("no object of the label set on its probe sequence")

// walk goes along the probe sequence from its start.
func (a *allocation) walk(ctx context.Context, p idprobe.Sequence) (identity.NumericIdentity, bool, error) {
	start := time.Now()
	a.walkStart, a.stepped, a.firstAnnounce, a.refreshes = start, nil, time.Time{}, 0
	clear(a.announced)
	clear(a.refreshed)
	if a.s.ids.full() {
		// Decided at once, however large the range, rather than
		// after a walk past every slot.
		return a.reclaimOrRefuse(ctx, p)
	}
	for i := uint64(0); i < p.Len(); {
		if time.Since(start) > maxWalkAge {
			if err := a.conflict(); err != nil {
				return 0, false, err
			}
			return 0, false, errRestart
		}
		// The slots the cache shows held by other label sets are
		// passed under one lock.
		pos, e, stepped, ok := a.s.ids.scan(p, i, a.key, a.stepped)
		a.stepped = stepped
		if !ok {
			break
		}
		if e == nil {
			// Free in the cache, but another walk of this node may
			// be creating there.
			taken, err := a.s.pending.heldByOther(ctx, p.Slot(pos), a.key)
			if err != nil {
				return 0, false, err
			}
			if taken {
				i = pos + 1
				continue
			}
		}
		if e == nil && len(a.stepped) > 0 {
			id, created, err := a.reclaim(ctx, p, pos)
			switch {
			case errors.Is(err, errReclaimLater):
				if a.waitToReclaim(ctx, false) {
					return 0, false, errRestart
				}
			case !errors.Is(err, errNothingToReclaim):
				return id, created, err
			}
		}
		id := p.Slot(pos)
		done, created, err := a.trySlot(ctx, id, e)
		if err != nil || done {
			return id, created, err
		}
		i = pos + 1
	}
	return a.reclaimOrRefuse(ctx, p)
}

// reclaimOrRefuse ends a walk that found no free slot: it takes the slot of
// an identity the collector would delete, or refuses.
func (a *allocation) reclaimOrRefuse(ctx context.Context, p idprobe.Sequence) (identity.NumericIdentity, bool, error) {
	for {
		id, created, err := a.reclaim(ctx, p, p.Len())
		switch {
		case errors.Is(err, errReclaimLater):
			if a.waitToReclaim(ctx, true) {
				return 0, false, errRestart
			}
			// Waited long enough: take the first one due.
			continue
		case errors.Is(err, errNothingToReclaim):
			return 0, false, globalstore.ErrSpaceExhausted
		}
		return id, created, err
	}
}

// trySlot settles one slot of the walk, starting from what the cache shows
// of it (nil: free). done is true when the label set has its identity at
// id; false means go on to the next slot.
func (a *allocation) trySlot(ctx context.Context, id identity.NumericIdentity, e *entry) (done, created bool, err error) {
	s := a.s
	for {
		if e == nil && a.readOnly {
			s.stats.reads.Add(1)
			fresh, err := a.read(ctx, id)
			if err != nil {
				return false, false, err
			}
			if fresh == nil {
				return false, false, errNoSequenceObject
			}
			e = fresh
			continue
		}
		if e == nil {
			if d := s.createDelay(a.key); d > 0 && !a.waited {
				a.waited = true
				if e = s.ids.waitFor(ctx, id, d); e != nil {
					if e.key == a.key {
						s.contention.lost()
					}
					continue
				}
			}
			slot, mine := a.claimed, a.claimed != nil && a.claimed.id == id
			if !mine {
				slot, mine = s.pending.claim(id, a.key, time.Now())
			}
			a.claimed = nil
			if !mine {
				// Another walk of this node creates there: its
				// outcome, not a conflict, tells whether the slot
				// is free.
				held, err := slot.wait(ctx)
				switch {
				case err != nil:
					return false, false, err
				case !held:
					continue
				case slot.key != a.key:
					return false, false, nil
				}
				// This label set's object, which another walk of
				// this node created: read it.
				s.stats.reads.Add(1)
				if e, err = a.read(ctx, id); err != nil {
					return false, false, err
				}
				if e == nil {
					return false, false, errRestart
				}
				continue
			}
			if err := a.recheck(ctx, id); err != nil {
				s.pending.finish(slot, false)
				return false, false, err
			}
			began := time.Now()
			err := s.create(ctx, id, a.lbls)
			s.pending.finish(slot, err == nil || apierrors.IsAlreadyExists(err))
			if err == nil {
				s.contention.won(time.Since(began))
				return true, true, nil
			}
			if !apierrors.IsAlreadyExists(err) {
				if err := a.retry(ctx, err); err != nil {
					return false, false, err
				}
				continue
			}
			if err := a.conflict(); err != nil {
				return false, false, err
			}
			// The cache was behind: take the object from the watch
			// once it arrives, else read it.
			if e = s.ids.waitFor(ctx, id, cacheWait); e == nil {
				s.stats.reads.Add(1)
				if e, err = a.read(ctx, id); err != nil {
					return false, false, err
				}
			}
			if e != nil && e.key == a.key {
				s.contention.lost()
			}
			continue
		}
		if e.key == a.key {
			if err := a.adopt(ctx, e); err != nil {
				if errors.Is(err, errRestart) {
					// The object changed or vanished: look again.
					if e, err = a.read(ctx, id); err != nil {
						return false, false, err
					}
					continue
				}
				return false, false, err
			}
			a.adopted = id
			return true, false, nil
		}
		if e.obj != nil && e.marked() {
			// A new identity further on would depend on this slot
			// staying held: announced before the create if its
			// mark is old (recheck). Its mark stays, so that its
			// timeout goes on.
			a.stepped = append(a.stepped, e)
		}
		return false, false, nil
	}
}

// recheck is the walk's last look at the cache before it creates the
// label set's object at id, read under one lock with nothing but the
// create after it: the object must not become a second one of the set,
// and the collector must not free a slot before it while a node that does
// not see it yet could walk there (docs/crd-store.md, "One ID per label
// set"). It restarts the walk (errRestart) when the cache now shows an
// object of the set that identityd placed, or one at or before id on the
// sequence, or a slot before id free: the cache caught up with a change
// the walk did not see. It announces the steps over marked objects before
// id that a collector could delete before the object is in its cache
// (stepNoteAge), as the cache shows their marks now, not as the walk
// first saw them, with their resourceVersion as precondition: a collector
// that listed such an object before the write leaves it until the
// announcement is older than gcStepWindow, by when the create is in its
// cache; one that listed it after fails its delete on the changed
// resourceVersion. The create follows the walk's first announcement
// within maxAnnounceAge, and the walk's start within maxWalkAge, or the
// walk starts again.
func (a *allocation) recheck(ctx context.Context, id identity.NumericIdentity) error {
	s := a.s
	pos, onSequence := a.seq.Position(id)
	for {
		var marked []*entry
		if onSequence {
			var ok bool
			if marked, ok = s.ids.dependsOn(a.seq, pos, a.key); !ok {
				if err := a.conflict(); err != nil {
					return err
				}
				return errRestart
			}
		}
		for i, e := range marked {
			if r := a.refreshed[e.id]; r != nil {
				marked[i] = r
			}
		}
		due := a.dueSteps(marked, time.Now())
		if len(due) == 0 {
			break
		}
		if a.firstAnnounce.IsZero() {
			a.firstAnnounce = time.Now()
		}
		left, err := s.announce(ctx, due)
		for _, e := range due {
			if !slices.Contains(left, e) {
				a.announced[e.id] = true
			}
		}
		switch {
		case err == nil:
			continue
		case apierrors.IsConflict(err):
			// Most often another walk announced its step over the
			// same object first, and the cache does not show it yet:
			// announce on the object as it is now.
			if err := a.refresh(ctx, left); err != nil {
				return err
			}
			continue
		case apierrors.IsNotFound(err):
			if err := a.conflict(); err != nil {
				return err
			}
			return errRestart
		}
		if err := a.retry(ctx, err); err != nil {
			return err
		}
	}
	now := time.Now()
	if (!a.walkStart.IsZero() && now.Sub(a.walkStart) > maxWalkAge) ||
		(!a.firstAnnounce.IsZero() && now.Sub(a.firstAnnounce) > maxAnnounceAge) {
		if err := a.conflict(); err != nil {
			return err
		}
		return errRestart
	}
	return nil
}

// maxStepRefreshes bounds the reads of objects whose announcement met a
// change, in one walk, before the walk counts a conflict and starts again.
const maxStepRefreshes = 16

// refresh reads the objects of left, whose step annotation was not
// written, for the next announcement (a.refreshed). An object that is
// gone, or is now another object or another label set's, restarts the
// walk, as a changed slot does; one whose mark was removed needs no
// announcement (a new mark is younger than stepNoteAge).
func (a *allocation) refresh(ctx context.Context, left []*entry) error {
	for _, e := range left {
		a.refreshes++
		if a.refreshes > maxStepRefreshes {
			if err := a.conflict(); err != nil {
				return err
			}
			return errRestart
		}
		fresh, err := a.read(ctx, e.id)
		if err != nil {
			return err
		}
		if fresh == nil || fresh.obj == nil || fresh.key != e.key || fresh.obj.UID != e.obj.UID {
			if err := a.conflict(); err != nil {
				return err
			}
			return errRestart
		}
		if !fresh.marked() {
			a.announced[e.id] = true
			continue
		}
		a.refreshed[e.id] = fresh
	}
	return nil
}

// Why a young mark needs no step annotation: an identityd collector
// deletes a marked object only when its mark is at least its timeout old,
// and no collector's timeout is shorter than MinHeartbeatTimeout (Validate;
// the grace without Cilium agents is at least that too). A walk checks the
// marks before its slot in its cache just before it creates (recheck). An
// object whose mark is then younger than the timeout less maxCacheLag and
// stepClockMargin is deleted, if ever, after a run that started at least
// maxCacheLag after the create, whose cache therefore shows the walk's
// object: the fence keeps the slot while that object is young, and once it
// is old every node's cache shows it. An object the check sees unmarked
// was marked at most maxCacheLag before the check, so the same holds for
// it, as MinHeartbeatTimeout is twice maxCacheLag. stepClockMargin covers
// the difference between the walking node's clock and the collecting
// node's, which compares the same mark with its own. A Cilium operator's
// collection ignores the annotation anyway.
const (
	// stepClockMargin is how far the nodes' clocks may disagree.
	stepClockMargin = 10 * time.Second
	// stepNotesInFlight bounds the step annotations a walk has sent and
	// not seen answered, as gcMarksInFlight bounds the collector's marks.
	stepNotesInFlight = 8
	// maxAnnounceAge bounds the time from a walk's first step
	// annotation to its create (gcStepWindow).
	maxAnnounceAge = 10 * time.Second
)

// stepNoteAge is the age of a heartbeat mark, at the walk's create, from
// which the walk announces its step over the object: the shortest timeout
// any collector may use (shorter where tests shorten the store's own) less
// the lag of the collector's cache and the clocks' margin. A negative age
// announces every step.
func (s *Store) stepNoteAge() time.Duration {
	return min(MinHeartbeatTimeout, s.gc.cfg.HeartbeatTimeout, s.gc.minGrace) - maxCacheLag - stepClockMargin
}

// dueSteps returns the objects of marked that need the step annotation at
// now and that this walk has not announced: those whose mark is at least
// stepNoteAge old, or cannot be dated.
func (a *allocation) dueSteps(marked []*entry, now time.Time) []*entry {
	noteAge := a.s.stepNoteAge()
	var due []*entry
	for _, e := range marked {
		if a.announced[e.id] {
			continue
		}
		at, err := time.Parse(time.RFC3339Nano, e.obj.Annotations[HeartbeatAnnotation])
		if err != nil || now.Sub(at) >= noteAge {
			due = append(due, e)
		}
	}
	return due
}

// announce writes the step annotation on each object of due,
// stepNotesInFlight at a time. left holds those not written; err is a
// Conflict or NotFound if one came, else the first other failure.
func (s *Store) announce(ctx context.Context, due []*entry) (left []*entry, err error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := make([]error, len(due))
	var (
		wg   sync.WaitGroup
		next atomic.Int64
	)
	for range min(stepNotesInFlight, len(due)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= len(due) {
					return
				}
				if errs[i] = ctx.Err(); errs[i] != nil {
					continue
				}
				e := due[i]
				patch := fmt.Appendf(nil, `{"metadata":{"resourceVersion":%q,"annotations":{%q:%q}}}`,
					e.obj.ResourceVersion, stepAnnotation, time.Now().UTC().Format(time.RFC3339Nano))
				if _, errs[i] = patchMetadataOnly(ctx, s.ciliumClient, "ciliumidentities", e.id.String(), patch); errs[i] != nil {
					// The walk restarts or waits: the others need
					// not be sent.
					cancel()
				}
			}
		}()
	}
	wg.Wait()
	rank := func(err error) int {
		switch {
		case err == nil:
			return 0
		case errors.Is(err, context.Canceled):
			return 1
		case apierrors.IsConflict(err) || apierrors.IsNotFound(err):
			return 3
		}
		return 2
	}
	for i, e := range due {
		if errs[i] == nil {
			continue
		}
		left = append(left, e)
		if rank(errs[i]) > rank(err) {
			err = errs[i]
		}
	}
	return left, err
}

// adopt takes e, an object of the label set, removing its heartbeat mark
// as Cilium's agents do. errRestart: the object changed or is gone.
func (a *allocation) adopt(ctx context.Context, e *entry) error {
	if !e.marked() {
		return nil
	}
	return a.unmark(ctx, e)
}

// unmark removes e's heartbeat mark, with e's resourceVersion as
// precondition. errRestart: the object changed or is gone meanwhile.
func (a *allocation) unmark(ctx context.Context, e *entry) error {
	for {
		err := a.s.unmark(ctx, e.id, e.obj.ResourceVersion)
		switch {
		case err == nil:
			return nil
		case apierrors.IsConflict(err) || apierrors.IsNotFound(err):
			if err := a.conflict(); err != nil {
				return err
			}
			return errRestart
		}
		if err := a.retry(ctx, err); err != nil {
			return err
		}
	}
}

// read returns the object of id from the API server: nil when there is
// none; an entry of no label set when it does not parse (it holds the ID
// all the same).
func (a *allocation) read(ctx context.Context, id identity.NumericIdentity) (*entry, error) {
	for {
		var obj CiliumIdentity
		err := a.s.ciliumClient.Get().Resource("ciliumidentities").Name(id.String()).Do(ctx).Into(&obj)
		switch {
		case err == nil:
			e, perr := a.s.ids.parse(&obj)
			if perr != nil {
				return &entry{id: id, key: unparsedKey}, nil
			}
			return e, nil
		case apierrors.IsNotFound(err):
			return nil, nil
		}
		if err := a.retry(ctx, err); err != nil {
			return nil, err
		}
	}
}

// unparsedKey is the key of an object whose labels do not parse: no
// canonical string holds a control character.
const unparsedKey = "\x00"

// create sends the CiliumIdentity of id for lbls.
func (s *Store) create(ctx context.Context, id identity.NumericIdentity, lbls labels.Labels) error {
	return s.ciliumClient.Post().Resource("ciliumidentities").Param("fieldManager", fieldManager).
		Body(newIdentityObject(id, lbls)).Do(ctx).Error()
}

// fieldManager is the name under which identityd creates CiliumIdentity
// objects: the API server records it in the object's managedFields, as the
// owner of the security-labels, which tells the objects identityd placed
// (by its walk, or at etcd's ID in a migration) from a Cilium agent's
// without a field of identityd's own in the object.
const fieldManager = "identityd"

// newIdentityObject returns the CiliumIdentity of id for lbls, as Cilium
// writes it (with the object labels the API server accepts).
func newIdentityObject(id identity.NumericIdentity, lbls labels.Labels) *CiliumIdentity {
	objLabels, _ := objectLabels(lbls)
	return &CiliumIdentity{
		TypeMeta:       metav1.TypeMeta{APIVersion: CiliumGroup + "/" + CiliumVersion, Kind: "CiliumIdentity"},
		ObjectMeta:     metav1.ObjectMeta{Name: id.String(), Labels: objLabels},
		SecurityLabels: securityLabels(lbls),
	}
}

// unmark removes the heartbeat mark of id's object, if its resourceVersion
// is still rv.
func (s *Store) unmark(ctx context.Context, id identity.NumericIdentity, rv string) error {
	patch := fmt.Appendf(nil, `{"metadata":{"resourceVersion":%q,"annotations":{%q:null}}}`, rv, HeartbeatAnnotation)
	_, err := patchMetadataOnly(ctx, s.ciliumClient, "ciliumidentities", id.String(), patch)
	if err == nil {
		s.stats.unmarked.Add(1)
		s.log.Info("Removed the heartbeat mark of a global identity this node needs", "id", id)
	}
	return err
}

// Release implements globalstore.Backend: the identity leaves this node's
// IdentityNode record with the next write. The node never deletes a
// CiliumIdentity; the garbage collection does once no node uses it.
func (s *Store) Release(ctx context.Context, ref *globalstore.Reference) error {
	if !s.stopped.Load() {
		s.writer.request(false)
		if s.unmarks.taken.Load() > 0 {
			// An ID found taken stops being reported once released.
			s.unmarks.signal()
		}
		// So does a label set held split.
		s.splits.signalIfSplit(s.ids, ref.Labels.Canonical())
	}
	return nil
}

// transient tells failures another attempt may get past (timeouts, a
// restarting or overloaded server, a broken connection) from refusals it
// would meet again.
func transient(err error) bool {
	if errors.Is(err, context.Canceled) {
		return false
	}
	var st apierrors.APIStatus
	if errors.As(err, &st) {
		return apierrors.IsServerTimeout(err) || apierrors.IsTimeout(err) || apierrors.IsTooManyRequests(err) ||
			apierrors.IsInternalError(err) || apierrors.IsServiceUnavailable(err) || apierrors.IsUnexpectedServerError(err) ||
			st.Status().Code >= 500
	}
	// Not an answer of the API server: the connection broke, timed out or
	// was refused (a restarting server).
	return true
}
