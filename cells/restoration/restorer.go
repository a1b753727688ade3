package restoration

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/checkpoint"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/ipcachemap"
	"github.com/identityd/identityd/labels"
)

// Owner is the ipcache owner of the metadata restoration re-creates for the
// prefixes of the old datapath map. It is removed after the grace period.
const Owner ipcache.ResourceID = "restored"

// initializerName is the ipcache table initializer restoration holds until
// the old map's prefixes are back in the table: before that, pruning would
// delete them from the datapath.
const initializerName = "restoration"

// maxLoggedSkips bounds the warnings logged one by one for skipped entries;
// a checkpoint from an incompatible version could otherwise log 100,000
// lines. The rest are counted and summarized.
const maxLoggedSkips = 10

// State is the phase of restoration.
type State string

// States of restoration, in order.
const (
	// StatePending: the start hook has not run yet.
	StatePending State = "pending"
	// StateHolding: restored identities and prefixes are held until the
	// grace period ends.
	StateHolding State = "holding"
	// StateReleased: the restorer holds nothing any more.
	StateReleased State = "released"
)

// Counters count what restoration did, for status and metrics.
type Counters struct {
	// Restored is the number of checkpoint identities that got their old
	// numeric ID back.
	Restored uint64 `json:"restored"`
	// Skipped is the number of checkpoint entries not restored: invalid
	// entries, entries whose label set now has another scope (or needs a
	// global identity), and failed allocations.
	Skipped uint64 `json:"skipped"`
	// Renumbered is the number of checkpoint identities whose old ID was
	// taken, so that their label set got another one.
	Renumbered uint64 `json:"renumbered"`
	// PrefixesRestored is the number of old map prefixes re-created in the
	// ipcache.
	PrefixesRestored uint64 `json:"prefixes-restored"`
	// PrefixesFailed is the number of old map prefixes the ipcache refused.
	PrefixesFailed uint64 `json:"prefixes-failed"`
	// ReleasedAfterGrace is the number of restored identities that were
	// freed when the restorer let go of them, because nobody had taken them
	// up during the grace period.
	ReleasedAfterGrace uint64 `json:"released-after-grace"`
}

// Status is the state of restoration, for the restore-status command.
type Status struct {
	State State `json:"state"`
	// CheckpointFound tells whether a checkpoint file was there.
	CheckpointFound bool `json:"checkpoint-found"`
	// CheckpointError is why the checkpoint was not (fully) usable.
	CheckpointError string `json:"checkpoint-error,omitempty"`
	// OldMapEntries is the number of entries of the old datapath map.
	OldMapEntries int `json:"old-map-entries"`
	// HeldIdentities is the number of identity references the restorer
	// holds, WithheldIDs the number of numeric IDs it keeps withheld for
	// prefixes whose labels it did not know, HeldPrefixes the number of
	// prefixes it contributes to.
	HeldIdentities int `json:"held-identities"`
	WithheldIDs    int `json:"withheld-ids"`
	HeldPrefixes   int `json:"held-prefixes"`
	// GracePeriod is the time between the end of restoration and the
	// release.
	GracePeriod time.Duration `json:"grace-period"`
	// RestoreDuration is how long the start hook's restoration took.
	RestoreDuration time.Duration `json:"restore-duration"`
	// ReleaseAt is when the release runs (zero before restoration).
	ReleaseAt time.Time `json:"release-at,omitzero"`
	// ReleaseDuration is how long the release took (zero before).
	ReleaseDuration time.Duration `json:"release-duration,omitempty"`
	Counters        Counters      `json:"counters"`
}

// Restorer restores the local identities of the checkpoint and the
// prefixes of the old datapath map at start, and lets go of them after the
// grace period. Every method is safe for concurrent use.
type Restorer struct {
	log       *slog.Logger
	alloc     allocator.Allocator
	cp        *checkpoint.Checkpoint
	ipc       *ipcache.IPCache
	dualStack bool
	grace     time.Duration

	// initDone marks restoration's ipcache initializer done.
	initDone func()
	// done is closed when the start hook has restored what it could.
	done chan struct{}

	// mu guards the fields below. The start hook and the release never
	// overlap: the release waits for done.
	mu              sync.Mutex
	state           State
	held            []*identity.Identity
	withheld        []identity.NumericIdentity
	heldPrefixes    int
	oldMapEntries   int
	found           bool
	checkpointErr   string
	restoreDuration time.Duration
	releaseAt       time.Time
	releaseDuration time.Duration

	restored, skipped, renumbered, prefixesRestored, prefixesFailed, releasedAfterGrace atomic.Uint64
}

type params struct {
	cell.In

	Config        Config
	IPCacheConfig ipcache.Config
	Log           *slog.Logger
	Lifecycle     cell.Lifecycle
	Jobs          job.Registry
	Health        cell.Health
	Allocator     allocator.Allocator
	Checkpoint    *checkpoint.Checkpoint
	IPCache       *ipcache.IPCache
	KVStore       *kvstore.Client `optional:"true"`
}

func newRestorer(p params) (*Restorer, error) {
	if err := p.Config.Validate(); err != nil {
		return nil, err
	}
	external := p.KVStore != nil && !p.KVStore.Embedded()
	r := &Restorer{
		log:       p.Log,
		alloc:     p.Allocator,
		cp:        p.Checkpoint,
		ipc:       p.IPCache,
		dualStack: p.IPCacheConfig.IPCacheDualStack,
		grace:     p.Config.gracePeriod(external),
		done:      make(chan struct{}),
		state:     StatePending,
	}
	// Registered before any hook runs, so that the ipcache never counts
	// its table initialized, and never prunes the map, before the old
	// prefixes are back.
	r.initDone = p.IPCache.RegisterInitializer(initializerName)
	// The hook is appended before the job's, so the job starts after the
	// restoration and stops before anything the release needs.
	p.Lifecycle.Append(r)
	p.Jobs.NewGroup(p.Health).Add(job.OneShot("restore-grace-period", r.releaseAfterGrace))
	return r, nil
}

// Done returns a channel closed once the start hook has restored what it
// could. Cells that allocate local identities after start but outside a
// start hook that depends on the Restorer can wait on it.
func (r *Restorer) Done() <-chan struct{} { return r.done }

// GracePeriod returns the grace period in effect (the automatic choice
// resolved).
func (r *Restorer) GracePeriod() time.Duration { return r.grace }

// Counters returns the counters.
func (r *Restorer) Counters() Counters {
	return Counters{
		Restored:           r.restored.Load(),
		Skipped:            r.skipped.Load(),
		Renumbered:         r.renumbered.Load(),
		PrefixesRestored:   r.prefixesRestored.Load(),
		PrefixesFailed:     r.prefixesFailed.Load(),
		ReleasedAfterGrace: r.releasedAfterGrace.Load(),
	}
}

// Status returns the state of restoration.
func (r *Restorer) Status() Status {
	r.mu.Lock()
	defer r.mu.Unlock()
	return Status{
		State:           r.state,
		CheckpointFound: r.found,
		CheckpointError: r.checkpointErr,
		OldMapEntries:   r.oldMapEntries,
		HeldIdentities:  len(r.held),
		WithheldIDs:     len(r.withheld),
		HeldPrefixes:    r.heldPrefixes,
		GracePeriod:     r.grace,
		RestoreDuration: r.restoreDuration,
		ReleaseAt:       r.releaseAt,
		ReleaseDuration: r.releaseDuration,
		Counters:        r.Counters(),
	}
}

// Held returns the identities the restorer still holds a reference on,
// in restoration order.
func (r *Restorer) Held() []identity.Identity {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]identity.Identity, len(r.held))
	for i, id := range r.held {
		out[i] = *id
	}
	return out
}

// Start restores. It never fails: whatever cannot be restored is logged
// and counted, and the agent starts with the rest.
func (r *Restorer) Start(ctx cell.HookContext) error {
	r.restore(ctx)
	return nil
}

// Stop keeps what is held: the final checkpoint written after this hook
// then still lists the restored identities nobody took up yet, so a quick
// restart loses none of them.
func (r *Restorer) Stop(cell.HookContext) error { return nil }

func (r *Restorer) restore(ctx context.Context) {
	start := time.Now()
	// Whatever happens, the ipcache must become initialized, or stale map
	// entries would never be pruned.
	defer func() {
		r.initDone()
		d := time.Since(start)
		r.mu.Lock()
		r.state = StateHolding
		r.restoreDuration = d
		r.releaseAt = time.Now().Add(r.grace)
		r.mu.Unlock()
		close(r.done)
		c := r.Counters()
		r.log.Info("Restored local identities and ipcache prefixes",
			"restored", c.Restored, "skipped", c.Skipped, "renumbered", c.Renumbered,
			"prefixes", c.PrefixesRestored, "prefixes-failed", c.PrefixesFailed,
			"duration", d, "grace-period", r.grace)
	}()

	restoredLabels := r.restoreCheckpoint(ctx)
	r.restorePrefixes(ctx, restoredLabels)
}

// restoreCheckpoint re-allocates the checkpoint's identities with their old
// numbers and returns the labels of those that got them, by ID.
func (r *Restorer) restoreCheckpoint(ctx context.Context) map[identity.NumericIdentity]labels.Labels {
	res, err := r.cp.Load()
	r.mu.Lock()
	r.found = res.Report.Found
	switch {
	case err != nil:
		r.checkpointErr = err.Error()
	case res.Report.Corrupt != nil:
		r.checkpointErr = res.Report.Corrupt.Error()
	case len(res.Report.Invalid) > 0:
		r.checkpointErr = fmt.Sprintf("%d invalid entries", len(res.Report.Invalid))
	}
	r.mu.Unlock()
	if err != nil {
		r.log.Warn("Cannot load the identity checkpoint, restoring from the ipcache map only", "error", err)
	}
	if res.Report.Corrupt != nil {
		r.log.Warn("Identity checkpoint is corrupt, restoring from the ipcache map only",
			"error", res.Report.Corrupt, "kept-as", res.Report.SetAside)
	}
	if n := len(res.Report.Invalid); n > 0 {
		r.skipped.Add(uint64(n))
		r.log.Warn("Identity checkpoint has invalid entries, skipping them",
			"invalid", n, "kept-as", res.Report.SetAside)
	}
	if len(res.Identities) == 0 {
		return nil
	}

	reqs := make([]allocator.Request, 0, len(res.Identities))
	old := make([]identity.NumericIdentity, 0, len(res.Identities))
	var skipped int
	for _, id := range res.Identities {
		scope := identity.ScopeForLabels(id.Labels)
		if !id.ID.HasLocalScope() || scope != id.ID.Scope() {
			// The label set's scope changed (another version's scope
			// rules) or it now needs a global identity: its old number
			// means nothing to the allocator any more.
			skipped++
			if skipped <= maxLoggedSkips {
				r.log.Warn("Skipping checkpoint identity whose scope changed",
					"identity", id.ID, "labels", id.Labels, "scope", scope)
			}
			continue
		}
		reqs = append(reqs, allocator.Request{Labels: id.Labels, OldID: id.ID, Restored: true})
		old = append(old, id.ID)
	}

	// Withholding first keeps every old number out of reach of the new
	// identities the batch might have to create, so that no restored
	// identity takes another one's number.
	r.alloc.Withhold(old)
	results := r.alloc.AllocateBatch(ctx, reqs)
	r.alloc.Unwithhold(old)

	byID := make(map[identity.NumericIdentity]labels.Labels, len(reqs))
	held := make([]*identity.Identity, 0, len(reqs))
	var renumbered int
	for i, res := range results {
		req := &reqs[i]
		if res.Err != nil {
			skipped++
			if skipped <= maxLoggedSkips {
				r.log.Warn("Cannot restore checkpoint identity",
					"identity", req.OldID, "labels", req.Labels, "error", res.Err)
			}
			continue
		}
		held = append(held, res.Identity)
		if res.Identity.ID != req.OldID {
			renumbered++
			if renumbered <= maxLoggedSkips {
				r.log.Warn("Checkpoint identity got another number",
					"old", req.OldID, "new", res.Identity.ID, "labels", req.Labels)
			}
			continue
		}
		byID[req.OldID] = res.Identity.Labels
	}
	if skipped > maxLoggedSkips || renumbered > maxLoggedSkips {
		r.log.Warn("Checkpoint identities not restored as they were", "skipped", skipped, "renumbered", renumbered)
	}
	r.skipped.Add(uint64(skipped))
	r.renumbered.Add(uint64(renumbered))
	r.restored.Add(uint64(len(byID)))

	r.mu.Lock()
	r.held = held
	r.mu.Unlock()
	return byID
}

// restorePrefixes re-creates ipcache metadata for the prefixes of the old
// map whose identity was node-local, so that they get the same identity
// and the reconciler neither prunes nor changes their entries.
func (r *Restorer) restorePrefixes(ctx context.Context, byID map[identity.NumericIdentity]labels.Labels) {
	snap := r.ipc.TakeSnapshot()
	r.mu.Lock()
	r.oldMapEntries = len(snap)
	r.mu.Unlock()
	if len(snap) == 0 {
		return
	}

	// Other entries (global identities, tunnelled endpoints, remote
	// clusters) are re-created by their owners, which know them better.
	keep := make([]ipcachemap.Entry, 0, len(snap))
	// shared counts the kept prefixes of IDs not restored from the
	// checkpoint; other IDs need no count.
	shared := map[identity.NumericIdentity]int{}
	for _, e := range snap {
		if !restorable(e) {
			continue
		}
		keep = append(keep, e)
		if _, ok := byID[e.Value.Identity]; !ok {
			shared[e.Value.Identity]++
		}
	}

	updates := make([]ipcache.Update, len(keep))
	var withheld []identity.NumericIdentity
	var requested []int
	for i, e := range keep {
		id, p := e.Value.Identity, e.Key.Prefix
		u := &updates[i]
		u.Prefix = p
		lbls, known := byID[id]
		switch {
		case id == identity.ReservedIdentityIngress:
			// Ingress is reserved: only a direct identity keeps it.
			u.Info.Identity = id
		case known && r.mergesTo(p, lbls):
			// The ipcache adds the prefix's CIDR labels to these, which
			// gives back the restored label set and so its identity.
			u.Info.Labels = lbls
		case known:
			// The label set does not derive from the prefix (e.g. FQDN
			// labels): keep the number as is. The restorer's reference
			// keeps the identity alive.
			u.Info.Identity = id
		default:
			// The labels are unknown (the checkpoint is older than the
			// map, or gone). Withhold the number so that nothing else
			// takes it, and ask for it.
			if n := shared[id]; n > 0 {
				withheld = append(withheld, id)
				shared[id] = -n // withheld once
			}
			if shared[id] < -1 {
				// Several prefixes shared it: each would get its own
				// CIDR label set, so only one could have the number.
				// A direct identity keeps it for all.
				u.Info.Identity = id
			} else {
				u.Info.RequestedID = id
				requested = append(requested, i)
			}
		}
	}
	r.alloc.Withhold(withheld)
	r.mu.Lock()
	r.withheld = withheld
	r.mu.Unlock()

	failed := countErrors(r.ipc.UpsertBatch(ctx, Owner, updates), r.log)

	// A requested ID is not honoured when the prefix's CIDR label set
	// already has another identity; pin those prefixes to their number.
	var fix []ipcache.Update
	for _, i := range requested {
		u := updates[i]
		if e, ok := r.ipc.LookupPrefix(u.Prefix); ok && e.Identity != u.Info.RequestedID {
			fix = append(fix, ipcache.Update{Prefix: u.Prefix, Info: ipcache.Info{Identity: u.Info.RequestedID}})
		}
	}
	if len(fix) > 0 {
		r.log.Warn("Old prefix identities not available, keeping them as direct identities", "prefixes", len(fix))
		failed += countErrors(r.ipc.UpsertBatch(ctx, Owner, fix), r.log)
	}

	r.prefixesRestored.Add(uint64(len(updates) - failed))
	r.prefixesFailed.Add(uint64(failed))
	r.mu.Lock()
	r.heldPrefixes = len(updates) - failed
	r.mu.Unlock()
}

// restorable tells whether an old map entry is restoration's business: a
// prefix of this cluster with a node-local (or the ingress) identity and no
// tunnel endpoint.
func restorable(e ipcachemap.Entry) bool {
	id := e.Value.Identity
	return e.Key.ClusterID == 0 && !e.Value.TunnelEndpoint.IsValid() &&
		(id.HasLocalScope() || id == identity.ReservedIdentityIngress)
}

// mergesTo tells whether the ipcache, merging the prefix's CIDR labels
// with lbls, gets lbls back: every CIDR label's key must be in lbls (the
// owner's label wins a key conflict), except the world label, which the
// ipcache drops when lbls hold another reserved label.
func (r *Restorer) mergesTo(p netip.Prefix, lbls labels.Labels) bool {
	reserved := false
	for _, l := range lbls {
		if l.Source == labels.SourceReserved && !isWorld(l) {
			reserved = true
			break
		}
	}
	if p.Bits() > 0 {
		if _, ok := lbls.Get(labels.CIDRKey(p)); !ok {
			return false
		}
	}
	if reserved {
		return true
	}
	_, ok := lbls.Get(labels.WorldLabel(p, r.dualStack).Key)
	return ok
}

func isWorld(l labels.Label) bool {
	return l == labels.LabelWorld || l == labels.LabelWorldIPv4 || l == labels.LabelWorldIPv6
}

// countErrors logs a batch error and returns how many prefixes failed.
func countErrors(err error, log *slog.Logger) int {
	if err == nil {
		return 0
	}
	n := 1
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		n = len(j.Unwrap())
		for i, e := range j.Unwrap() {
			if i == maxLoggedSkips {
				break
			}
			log.Warn("Cannot restore ipcache prefix", "error", e)
		}
	} else {
		log.Warn("Cannot restore ipcache prefixes", "error", err)
	}
	return n
}

// releaseAfterGrace is the grace-period job: it waits for restoration,
// then for the grace period, then releases. A hive stopped before keeps
// everything held (see Stop).
func (r *Restorer) releaseAfterGrace(ctx context.Context, health cell.Health) error {
	select {
	case <-r.done:
	case <-ctx.Done():
		return nil
	}
	r.mu.Lock()
	at := r.releaseAt
	r.mu.Unlock()
	health.OK(fmt.Sprintf("Holding restored state for %s", r.grace))
	t := time.NewTimer(time.Until(at))
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
		return nil
	}
	if err := r.Release(ctx); err != nil {
		health.Degraded("Release of restored state failed", err)
		return nil
	}
	health.OK("Restored state released")
	return nil
}

// Release lets go of everything restoration holds, as the grace-period job
// does when the period ends: the restored ipcache metadata is removed, each
// restored identity loses the restorer's reference and the withheld IDs
// are unwithheld. Identities and prefixes someone else took up in the
// meantime keep their numbers; the others are freed. It waits for
// restoration to finish; later calls do nothing.
func (r *Restorer) Release(ctx context.Context) error {
	select {
	case <-r.done:
	case <-ctx.Done():
		return ctx.Err()
	}
	start := time.Now()
	r.mu.Lock()
	if r.state == StateReleased {
		r.mu.Unlock()
		return nil
	}
	r.state = StateReleased
	held, withheld := r.held, r.withheld
	r.held, r.withheld, r.heldPrefixes = nil, nil, 0
	r.mu.Unlock()

	var errs []error
	// The metadata goes first: the prefixes' own references then drop
	// with it, and each restored identity's last reference is the
	// restorer's, released right after.
	prefixes, err := r.ipc.RemoveOwner(ctx, Owner)
	if err != nil {
		errs = append(errs, fmt.Errorf("remove restored ipcache metadata: %w", err))
	}
	var freed uint64
	for _, id := range held {
		released, err := r.alloc.Release(ctx, id)
		if err != nil {
			errs = append(errs, fmt.Errorf("release restored identity %d: %w", id.ID, err))
			continue
		}
		if released {
			freed++
		}
	}
	r.alloc.Unwithhold(withheld)
	r.releasedAfterGrace.Add(freed)
	d := time.Since(start)
	r.mu.Lock()
	r.releaseDuration = d
	r.mu.Unlock()
	err = errors.Join(errs...)
	r.log.Info("Released restored identities and ipcache prefixes",
		"identities", len(held), "freed", freed, "prefixes", prefixes,
		"unwithheld", len(withheld), "duration", d, "error", err)
	return err
}
