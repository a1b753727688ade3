package allocator

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/identitymetrics"
	"github.com/identityd/identityd/labels"
)

type params struct {
	cell.In

	Config    Config
	Log       *slog.Logger
	Lifecycle cell.Lifecycle
	DB        *statedb.DB
	Table     statedb.RWTable[Entry]
	Backend   globalstore.Backend `optional:"true"`
	Sinks     *globalstore.Sinks
	Remote    globalstore.Remote `optional:"true"`
	Metrics   *identitymetrics.Allocation
	Jobs      job.Registry
	Health    cell.Health `optional:"true"`

	// The store drivers the configured mode picks from (Backend, when
	// provided on its own, wins), and their shared configuration.
	Drivers []globalstore.Driver `group:"globalstore-drivers"`
	Stores  globalstore.Config
}

// allocatorOut is the Allocator, and the sink through which
// registerHandlers and registerContracts hand it what other cells provide.
type allocatorOut struct {
	cell.Out

	Allocator Allocator
	Sink      *handlerSink
}

// handlerSink takes the identity handlers, restorations and finalizers
// before the allocator starts.
type handlerSink struct {
	disp      *dispatcher
	contracts *contracts
}

type handlersParams struct {
	cell.In

	Sink     *handlerSink
	Handlers []Handler `group:"identity-handlers"`
}

// registerHandlers gives the allocator the handlers other cells provide
// (NewHandler). It is an invoke rather than a parameter of the allocator's
// constructor so that a handler's own constructor may depend on the
// Allocator: as a constructor parameter that would be a dependency cycle.
// Invokes run before start hooks, so the handlers see every change.
func registerHandlers(p handlersParams) {
	p.Sink.disp.handlers = append(p.Sink.disp.handlers, p.Handlers...)
}

// identityAllocator implements Allocator.
type identityAllocator struct {
	cfg    Config
	log    *slog.Logger
	queue  *eventQueue
	table  *tableWriter
	disp   *dispatcher
	local  *localScope
	remote *localScope
	global *globalRefs

	// reserved resolves reserved and well-known label sets under the
	// configured Cilium options.
	reserved *identity.ReservedResolver

	backend globalstore.Backend
	// mesh is the source of remote clusters' identities, or nil.
	mesh    globalstore.Remote
	metrics *identitymetrics.Allocation
	health  cell.Health // nil outside a hive with a health provider
	// space follows the fill of this cluster's global range; nil
	// without a global store.
	space  *spaceWatch
	synced chan struct{}
	once   sync.Once

	// contracts orders local allocations after restoration and runs the
	// finalizers at stop (restoration.go).
	contracts contracts
}

var _ Allocator = (*identityAllocator)(nil)

func newAllocator(p params) (allocatorOut, error) {
	if err := errors.Join(p.Config.Validate(), p.Stores.Validate()); err != nil {
		return allocatorOut{}, err
	}
	backend, err := driverBackend(p)
	if err != nil {
		return allocatorOut{}, err
	}
	a := newIdentityAllocator(p.Config, p.Log, p.DB, p.Table, backend, nil, identity.MaxLocalIdentity)
	a.metrics = p.Metrics
	if p.Remote != nil {
		a.mesh = p.Remote
		// Remote clusters' identities reach the dispatcher like the
		// global ones, marked as remote.
		p.Sinks.Remote().Bind(remoteEvents{a.queue}, nil)
	}
	a.health = p.Health
	if backend != nil {
		var h cell.Health
		if p.Health != nil {
			h = p.Health.NewScope("identity-space")
		}
		a.space = newSpaceWatch(p.Config.ClusterInfo(), p.Log, h)
		a.global.space = a.space
		// Bound before any store starts: the stores' hooks run after
		// every constructor.
		p.Sinks.For(p.Config.IdentityAllocationMode).Bind(a, a.global)
	}
	// Added before the allocator's hook, the jobs start before it and
	// stop after it: every change up to the end of the allocator's stop
	// reaches observers, handlers and the table.
	p.Jobs.NewGroup(health.OrDetached(p.Health)).Add(a.jobs()...)
	p.Lifecycle.Append(a)
	return allocatorOut{Allocator: a, Sink: &handlerSink{disp: a.disp, contracts: &a.contracts}}, nil
}

// driverBackend returns the Backend of the driver of the configured mode. In
// kvstore mode a hive without the etcd store serves local identities only,
// as it always has; crd mode asks for the CRD store explicitly, and the
// double-write modes for their cell, so their absence is an error rather
// than a silent loss of global identities.
func driverBackend(p params) (globalstore.Backend, error) {
	if p.Backend != nil {
		return p.Backend, nil
	}
	mode := p.Config.IdentityAllocationMode
	var found []globalstore.Driver
	for _, d := range p.Drivers {
		if d.Mode == mode {
			found = append(found, d)
		}
	}
	switch {
	case len(found) > 1:
		return nil, fmt.Errorf("--identity-allocation-mode=%s: %d store cells in the hive serve it, want one", mode, len(found))
	case len(found) == 0 && mode == identity.AllocationModeCRD:
		return nil, fmt.Errorf("--identity-allocation-mode=%s needs the CRD store of global identities in the hive (crdstore.Cell), which it does not have", mode)
	case len(found) == 0 && mode.DoubleWrite():
		return nil, fmt.Errorf("--identity-allocation-mode=%s needs the double-write cell (doublewrite.Cell) with both stores (etcdstore.Cell, crdstore.Cell) in the hive, which it does not have", mode)
	case len(found) == 0:
		return nil, nil
	}
	return found[0].Backend, nil
}

func newIdentityAllocator(cfg Config, log *slog.Logger, db *statedb.DB, table statedb.RWTable[Entry], backend globalstore.Backend, handlers []Handler, maxLocal identity.NumericIdentity) *identityAllocator {
	tw := newTableWriter(db, table)
	q := newEventQueue(tw)
	a := &identityAllocator{
		cfg:     cfg,
		log:     log,
		queue:   q,
		table:   tw,
		disp:    newDispatcher(q, handlers),
		local:   newLocalScope(identity.ScopeLocal, log, q, maxLocal),
		remote:  newLocalScope(identity.ScopeRemoteNode, log, q, maxLocal),
		global:  newGlobalRefs(backend, q, cfg.IdentityAllocationTimeout),
		backend: backend,
		mesh:    noRemote{},
		synced:  make(chan struct{}),
	}
	a.reserved = identity.NewReservedResolver(cfg.ReservedConfig())
	a.contracts.timeout = cfg.IdentityAllocationTimeout
	a.contracts.log = log
	a.contracts.open.Store(true)
	tw.known = a.disp.known
	for _, r := range a.reserved.Identities() {
		q.pushEvent(event{kind: ChangeUpsert, ident: r, source: SourceReserved})
	}
	if backend == nil {
		// Without a kvstore there is nothing global to wait for.
		a.Synced()
	}
	return a
}

// jobs returns the allocator's loops: the writer of the identities table
// and the dispatcher, which feeds it, Observe and the handlers. Each drains
// what is queued when its context ends; the dispatcher, listed last, stops
// first, so the table writer gets its last changes.
func (a *identityAllocator) jobs() []job.Job {
	return []job.Job{
		job.OneShot("identities-table-writer", func(ctx context.Context, _ cell.Health) error {
			a.table.Run(ctx)
			return nil
		}),
		// The dispatcher wakes at once: the reserved identities queued
		// by the constructor reach handlers before anything else.
		job.OneShot("identity-dispatcher", func(ctx context.Context, _ cell.Health) error {
			a.disp.run(ctx)
			return nil
		}),
	}
}

// Start reports whether global identities were listed. The global store
// and the remote clusters started before, by their own hooks: their cells
// are built before the allocator, which takes them.
func (a *identityAllocator) Start(ctx cell.HookContext) error {
	a.reportHealth()
	return nil
}

// reportHealth tells health whether global identities were listed: until
// then a global lookup may miss an identity other nodes created.
func (a *identityAllocator) reportHealth() {
	if a.health == nil {
		return
	}
	select {
	case <-a.synced:
		if a.backend == nil {
			a.health.OK("Local identities only: no global identity store in the hive")
		} else {
			a.health.OK("Global identities listed and watched")
		}
	default:
		// The kvstore's doing: the listing goes on and reports OK when it
		// completes; restarting the agent would not help.
		a.health.Degraded("Global identities not listed yet", health.External(errors.New("the first listing of the global identity store did not complete")))
	}
}

// Stop runs the finalizers (the final checkpoint); the dispatcher's job,
// stopped next, delivers what is queued, and the hooks of the global
// store and of the remote clusters stop after it.
func (a *identityAllocator) Stop(ctx cell.HookContext) error {
	return a.contracts.finalize(ctx)
}

// Upsert implements globalstore.Events.
func (a *identityAllocator) Upsert(id identity.NumericIdentity, lbls labels.Labels) {
	a.space.set(id, true)
	a.queue.pushEvent(event{kind: ChangeUpsert, ident: &identity.Identity{ID: id, Labels: lbls}, ref: a.global.lookupByID(id), source: SourceGlobal})
}

// Delete implements globalstore.Events.
func (a *identityAllocator) Delete(id identity.NumericIdentity, lbls labels.Labels) {
	a.space.set(id, false)
	a.queue.pushEvent(event{kind: ChangeDelete, ident: &identity.Identity{ID: id, Labels: lbls}, source: SourceGlobal})
}

// Synced implements globalstore.Events.
func (a *identityAllocator) Synced() {
	a.once.Do(func() {
		a.queue.pushEvent(syncEvent)
		close(a.synced)
		a.reportHealth()
	})
}

func (a *identityAllocator) scopeOf(s identity.Scope) *localScope {
	switch s {
	case identity.ScopeLocal:
		return a.local
	case identity.ScopeRemoteNode:
		return a.remote
	}
	return nil
}

func (a *identityAllocator) Allocate(ctx context.Context, lbls labels.Labels, opts ...AllocateOption) (*identity.Identity, bool, error) {
	if len(opts) == 0 {
		// Kept apart from the loop below, which hands the options to
		// unknown functions and so moves them to the heap: without
		// options an allocation allocates nothing for them.
		var o allocateOptions
		return a.allocate(ctx, lbls, &o)
	}
	o := new(allocateOptions)
	for _, opt := range opts {
		opt(o)
	}
	return a.allocate(ctx, lbls, o)
}

func (a *identityAllocator) allocate(ctx context.Context, lbls labels.Labels, o *allocateOptions) (*identity.Identity, bool, error) {
	if r := a.reserved.LookupByLabels(lbls); r != nil {
		return r, false, nil
	}
	start := monotonicNow()
	scope := identity.ScopeForLabels(lbls)
	var (
		id        *identity.Identity
		allocated bool
		err       error
	)
	if s := a.scopeOf(scope); s != nil {
		if err = a.contracts.admit(ctx, o.restored); err == nil {
			id, allocated, err = s.acquire(lbls, o)
		}
	} else {
		id, allocated, err = a.global.acquire(ctx, lbls, o)
	}
	a.metrics.Observe(scope, err, monotonicNow()-start)
	return id, allocated, err
}

func (a *identityAllocator) AllocateBatch(ctx context.Context, reqs []Request) []Result {
	// Waits before holding the events, which restoration's would wait for.
	waitErr := a.admitBatch(ctx, reqs)
	a.queue.hold()
	defer a.queue.release()
	out := make([]Result, len(reqs))
	for i, r := range reqs {
		if waitErr != nil && a.waitsForRestoration(r) {
			out[i].Err = waitErr
			continue
		}
		o := allocateOptions{oldID: r.OldID, restored: r.Restored, adoptOnly: r.AdoptOnly}
		id, allocated, err := a.allocate(ctx, r.Labels, &o)
		out[i] = Result{Identity: id, Allocated: allocated, Err: err}
	}
	return out
}

func (a *identityAllocator) Release(ctx context.Context, id *identity.Identity) (bool, error) {
	if id == nil {
		return false, fmt.Errorf("%w: nil identity", ErrUnknownIdentity)
	}
	if id.ID.IsReserved() {
		return false, nil
	}
	if s := a.scopeOf(id.ID.Scope()); s != nil {
		return s.release(id.ID)
	}
	return a.global.release(ctx, id.ID)
}

func (a *identityAllocator) LookupByLabels(lbls labels.Labels) *identity.Identity {
	if r := a.reserved.LookupByLabels(lbls); r != nil {
		return r
	}
	scope := identity.ScopeForLabels(lbls)
	if s := a.scopeOf(scope); s != nil {
		if e := s.lookup(lbls); e != nil {
			return &e.ident
		}
		return nil
	}
	var buf [keyBufSize]byte
	if e := a.global.lookupByKey(lbls.AppendCanonical(buf[:0])); e != nil {
		return &e.ident
	}
	if a.backend != nil {
		if id, ok := a.backend.LookupByLabels(lbls); ok {
			return &identity.Identity{ID: id, Labels: lbls}
		}
	}
	if id, ok := a.mesh.LookupByLabels(lbls); ok {
		return &identity.Identity{ID: id, Labels: lbls}
	}
	return nil
}

func (a *identityAllocator) LookupByID(id identity.NumericIdentity) *identity.Identity {
	if r := a.reserved.LookupByID(id); r != nil {
		return r
	}
	if s := a.scopeOf(id.Scope()); s != nil {
		if e := s.lookupByID(id); e != nil {
			return &e.ident
		}
		return nil
	}
	if e := a.global.lookupByID(id); e != nil {
		return &e.ident
	}
	if a.backend != nil {
		if lbls, ok := a.backend.LookupByID(id); ok {
			return &identity.Identity{ID: id, Labels: lbls}
		}
	}
	if lbls, ok := a.mesh.LookupByID(id); ok {
		return &identity.Identity{ID: id, Labels: lbls}
	}
	return nil
}

func (a *identityAllocator) List() []Entry {
	var out []Entry
	for _, r := range a.reserved.Identities() {
		out = append(out, Entry{Identity: r, Source: SourceReserved})
	}
	held := map[identity.NumericIdentity]bool{}
	collect := func(e *refEntry) {
		held[e.ident.ID] = true
		out = append(out, entryOf(e))
	}
	a.local.entries(collect)
	a.remote.entries(collect)
	a.global.entries(collect)
	// Global identities other nodes hold, and remote clusters' ones, as
	// far as the dispatcher knows.
	for _, id := range a.disp.snapshot() {
		if id.ID.IsReserved() || id.ID.HasLocalScope() || held[id.ID] {
			continue
		}
		source := SourceGlobal
		if _, remote := a.mesh.LookupByID(id.ID); remote {
			source = SourceRemote
		}
		out = append(out, Entry{Identity: id, Source: source})
	}
	slices.SortFunc(out, func(x, y Entry) int { return cmp.Compare(x.Identity.ID, y.Identity.ID) })
	return out
}

// entry returns id's entry as List has it, found by its number: the shell
// shows it after every allocation and lookup, and listing every identity
// for it would cost each call as much as the node holds.
func (a *identityAllocator) entry(id *identity.Identity) Entry {
	nid := id.ID
	if r := a.reserved.LookupByID(nid); r != nil {
		return Entry{Identity: r, Source: SourceReserved}
	}
	if s := a.scopeOf(nid.Scope()); s != nil {
		if e, ok := s.entry(nid); ok {
			return e
		}
		return Entry{Identity: id}
	}
	if e, ok := a.global.entry(nid); ok {
		return e
	}
	if !nid.IsReserved() && !nid.HasLocalScope() {
		if known := a.disp.lookup(nid); known != nil {
			source := SourceGlobal
			if _, remote := a.mesh.LookupByID(nid); remote {
				source = SourceRemote
			}
			return Entry{Identity: known, Source: source}
		}
	}
	return Entry{Identity: id}
}

func (a *identityAllocator) LocalIdentities() []*identity.Identity {
	out := make([]*identity.Identity, 0, a.local.len()+a.remote.len())
	add := func(e *refEntry) { out = append(out, &e.ident) }
	a.local.entries(add)
	a.remote.entries(add)
	return out
}

func (a *identityAllocator) Withhold(ids []identity.NumericIdentity) {
	a.local.withhold(ids)
	a.remote.withhold(ids)
}

func (a *identityAllocator) Unwithhold(ids []identity.NumericIdentity) {
	a.local.unwithhold(ids)
	a.remote.unwithhold(ids)
}

func (a *identityAllocator) Withheld() []identity.NumericIdentity {
	out := append(a.local.withheldIDs(), a.remote.withheldIDs()...)
	slices.Sort(out)
	return out
}

func (a *identityAllocator) WaitForInitialGlobalIdentities(ctx context.Context) error {
	select {
	case <-a.synced:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("waiting for the initial global identities: %w", ctx.Err())
	}
}

func (a *identityAllocator) Observe(ctx context.Context, next func(Change), complete func(error)) {
	a.disp.Observe(ctx, next, complete)
}

// remoteEvents reports a Remote's identities to the dispatcher, marked as
// remote.
type remoteEvents struct{ queue *eventQueue }

func (r remoteEvents) Upsert(id identity.NumericIdentity, lbls labels.Labels) {
	r.queue.pushEvent(event{kind: ChangeUpsert, ident: &identity.Identity{ID: id, Labels: lbls}, source: SourceRemote})
}

func (r remoteEvents) Delete(id identity.NumericIdentity, lbls labels.Labels) {
	r.queue.pushEvent(event{kind: ChangeDelete, ident: &identity.Identity{ID: id, Labels: lbls}, source: SourceRemote})
}

// Synced is not part of a Remote's reports.
func (remoteEvents) Synced() {}

// noRemote is the Remote of a hive without a cluster mesh.
type noRemote struct{}

func (noRemote) LookupByID(identity.NumericIdentity) (labels.Labels, bool)     { return nil, false }
func (noRemote) LookupByLabels(labels.Labels) (identity.NumericIdentity, bool) { return 0, false }
