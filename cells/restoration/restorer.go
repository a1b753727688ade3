package restoration

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/checkpoint"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/journal"
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
	// StateRestoring: the identities are restored, the prefixes of
	// restored identities are on their way into the ipcache.
	StateRestoring State = "restoring"
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
	// MapEntriesSharedID and MapEntriesOtherLabels count old map entries
	// skipped because they contradict the checkpoint: the entry's ID is
	// one the checkpoint gives a CIDR label set of another prefix, which
	// the map gives that ID as well (SharedID) or not (OtherLabels).
	MapEntriesSharedID    uint64 `json:"map-entries-shared-id"`
	MapEntriesOtherLabels uint64 `json:"map-entries-other-labels"`
	// ReleasedAfterGrace is the number of restored identities that were
	// freed when the restorer let go of them, because nobody had taken them
	// up during the grace period.
	ReleasedAfterGrace uint64 `json:"released-after-grace"`
	// SeenWithheld is the number of local numbers a state file or a
	// kept copy names (see checkpoint.LoadResult.Seen) that restoration
	// did not give back, withheld until the release.
	SeenWithheld uint64 `json:"seen-withheld"`
	// JournalSalvaged is the number of identity journal records found
	// intact after damage and replayed; JournalLostBytes the number of
	// its damaged bytes in no record.
	JournalSalvaged  uint64 `json:"journal-salvaged"`
	JournalLostBytes uint64 `json:"journal-lost-bytes"`
	// UnknownWithheld is the number of local numbers withheld until the
	// release because damage hid which of them were answered: every one
	// of each local scope up to unknownMargin above the highest number
	// seen that no restored identity holds.
	UnknownWithheld uint64 `json:"unknown-withheld"`
}

// Damage is what restoration found damaged in the identity journal, for
// the restore-status command; nil when nothing was.
type Damage struct {
	// Journal is why the journal was not read as a whole continuation of
	// the checkpoint: a damaged record or header, an empty file, another
	// checkpoint than the one loaded.
	Journal string `json:"journal"`
	// KeptAs is the copy of the damaged journal.
	KeptAs string `json:"kept-as,omitempty"`
	// Records is the number of its records replayed, Salvaged those of
	// them found after the damage, LostBytes its damaged bytes in no
	// record.
	Records   int   `json:"records"`
	Salvaged  int   `json:"salvaged"`
	LostBytes int64 `json:"lost-bytes"`
}

// Status is the state of restoration, for the restore-status command.
type Status struct {
	State State `json:"state"`
	// CheckpointFound tells whether a checkpoint file was there.
	CheckpointFound bool `json:"checkpoint-found"`
	// CheckpointError is why the checkpoint was not (fully) usable.
	CheckpointError string `json:"checkpoint-error,omitempty"`
	// JournalDamage is what was damaged in the identity journal.
	JournalDamage *Damage `json:"journal-damage,omitempty"`
	// MapJournalDamage is what was damaged in the datapath map file's
	// journal (the ipcache's file backend).
	MapJournalDamage *ipcache.MapJournalDamage `json:"map-journal-damage,omitempty"`
	// CopiesRead is the number of kept copies of the checkpoint and the
	// journal whose numbers are withheld with the others seen.
	CopiesRead int `json:"copies-read"`
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
	// RestoreDuration is how long the start hook's restoration took;
	// CheckpointDuration is its first part (load and re-allocation),
	// PrefixesDuration its second (the ipcache, for prefixes of unknown
	// label sets). BulkDuration is the time the job took to add the
	// prefixes of restored identities to the ipcache after the start.
	RestoreDuration    time.Duration `json:"restore-duration"`
	CheckpointDuration time.Duration `json:"checkpoint-duration"`
	PrefixesDuration   time.Duration `json:"prefixes-duration"`
	BulkDuration       time.Duration `json:"bulk-duration"`
	// ReleaseAt is when the release runs (zero before restoration).
	ReleaseAt time.Time `json:"release-at,omitzero"`
	// ReleaseDuration is how long the release took (zero before), and
	// ReleaseIdentitiesDuration the part of it spent releasing the
	// identities and unwithholding (the rest is the ipcache's).
	ReleaseDuration           time.Duration `json:"release-duration,omitempty"`
	ReleaseIdentitiesDuration time.Duration `json:"release-identities-duration,omitempty"`
	Counters                  Counters      `json:"counters"`
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
	// started is closed when the start hook begins; done when it has
	// restored what it could; ready when the prefixes are in the ipcache
	// too.
	started, done, ready chan struct{}
	// bulk holds the prefixes of restored identities between the start
	// hook and restoreBulk.
	bulk []ipcache.MapEntry

	// mu guards the fields below. The start hook, the bulk job and the
	// release never overlap: each waits for the one before.
	mu       sync.Mutex
	state    State
	held     []*identity.Identity
	withheld []identity.NumericIdentity
	// seen holds the numbers of the state files withheld until the
	// release (Counters.SeenWithheld).
	seen          []identity.NumericIdentity
	journalDamage *Damage
	// mapJournalDamage is the ipcache's report of its map journal.
	mapJournalDamage *ipcache.MapJournalDamage
	copiesRead       int
	heldPrefixes     int
	oldMapEntries    int
	found            bool
	checkpointErr    string
	restoreDuration  time.Duration
	cpDuration       time.Duration
	bulkDuration     time.Duration
	pfxDuration      time.Duration
	releaseAt        time.Time
	releaseDuration  time.Duration
	// releaseIDsDuration is the identities' part of releaseDuration.
	releaseIDsDuration time.Duration
	releasing          bool

	restored, skipped, renumbered, prefixesRestored, prefixesFailed, releasedAfterGrace atomic.Uint64
	mapSharedID, mapOtherLabels                                                         atomic.Uint64
	seenWithheld, journalSalvaged, journalLostBytes, unknownWithheld                    atomic.Uint64
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
	// AutomaticGrace, when the hive provides it, replaces the fallback
	// of the automatic grace period (see AutomaticGracePeriod).
	AutomaticGrace AutomaticGracePeriod `optional:"true"`
}

func newRestorer(p params) (*Restorer, error) {
	if err := p.Config.Validate(); err != nil {
		return nil, err
	}
	grace, err := p.Config.gracePeriod(p.AutomaticGrace)
	if err != nil {
		return nil, err
	}
	r := &Restorer{
		log:       p.Log,
		alloc:     p.Allocator,
		cp:        p.Checkpoint,
		ipc:       p.IPCache,
		dualStack: p.IPCacheConfig.IPCacheDualStack,
		grace:     grace,
		started:   make(chan struct{}),
		done:      make(chan struct{}),
		ready:     make(chan struct{}),
		state:     StatePending,
	}
	// Registered before any hook runs, so that the ipcache never counts
	// its table initialized, and never prunes the map, before the old
	// prefixes are back.
	r.initDone = p.IPCache.RegisterInitializer(initializerName)
	// The hook is appended before the job's, so the job starts after the
	// restoration and stops before anything the release needs.
	p.Lifecycle.Append(r)
	p.Jobs.NewGroup(p.Health).Add(
		job.OneShot("restore-prefixes", r.restoreBulk),
		job.OneShot("restore-grace-period", r.releaseAfterGrace),
	)
	return r, nil
}

// Done returns a channel closed once the start hook has restored the
// identities and protected the old numbers, whatever it could restore. It
// is the allocator.Restoration the cell registers: local allocations wait
// for it (Allocator.WaitForRestoration).
func (r *Restorer) Done() <-chan struct{} { return r.done }

// Started implements allocator.RestorationStarter: it is closed when the
// start hook begins.
func (r *Restorer) Started() <-chan struct{} { return r.started }

// Ready returns a channel closed once the old map's prefixes are back in
// the ipcache table as well, and the ipcache may prune the map.
func (r *Restorer) Ready() <-chan struct{} { return r.ready }

// GracePeriod returns the grace period in effect (the automatic choice
// resolved).
func (r *Restorer) GracePeriod() time.Duration { return r.grace }

// Counters returns the counters.
func (r *Restorer) Counters() Counters {
	return Counters{
		Restored:              r.restored.Load(),
		Skipped:               r.skipped.Load(),
		Renumbered:            r.renumbered.Load(),
		PrefixesRestored:      r.prefixesRestored.Load(),
		PrefixesFailed:        r.prefixesFailed.Load(),
		MapEntriesSharedID:    r.mapSharedID.Load(),
		MapEntriesOtherLabels: r.mapOtherLabels.Load(),
		ReleasedAfterGrace:    r.releasedAfterGrace.Load(),
		SeenWithheld:          r.seenWithheld.Load(),
		JournalSalvaged:       r.journalSalvaged.Load(),
		JournalLostBytes:      r.journalLostBytes.Load(),
		UnknownWithheld:       r.unknownWithheld.Load(),
	}
}

// Status returns the state of restoration.
func (r *Restorer) Status() Status {
	r.mu.Lock()
	defer r.mu.Unlock()
	return Status{
		State:                     r.state,
		CheckpointFound:           r.found,
		CheckpointError:           r.checkpointErr,
		JournalDamage:             r.journalDamage,
		MapJournalDamage:          r.mapJournalDamage,
		CopiesRead:                r.copiesRead,
		OldMapEntries:             r.oldMapEntries,
		HeldIdentities:            len(r.held),
		WithheldIDs:               len(r.withheld),
		HeldPrefixes:              r.heldPrefixes,
		GracePeriod:               r.grace,
		RestoreDuration:           r.restoreDuration,
		CheckpointDuration:        r.cpDuration,
		PrefixesDuration:          r.pfxDuration,
		BulkDuration:              r.bulkDuration,
		ReleaseAt:                 r.releaseAt,
		ReleaseDuration:           r.releaseDuration,
		ReleaseIdentitiesDuration: r.releaseIDsDuration,
		Counters:                  r.Counters(),
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

// Start restores the identities and protects the old numbers (see the
// package documentation); the bulk of the prefixes follows in a job.
// Whatever cannot be restored is logged and counted, and the agent starts
// with the rest; it fails only when the identity journal cannot be opened
// (checkpoint.ErrJournalUnusable): no local identity could be answered
// durably. Done is closed however it ends, as every
// other local allocation waits for it. Its own allocations, through the
// ipcache too, are marked allocator.Restoring: they must not wait for it.
func (r *Restorer) Start(hctx cell.HookContext) error {
	close(r.started)
	defer close(r.done)
	ctx := allocator.Restoring(hctx)
	start := time.Now()
	if err := r.restoreCheckpoint(ctx); err != nil {
		return err
	}
	mid := time.Now()
	r.bulk = r.restorePrefixes(ctx)
	d := time.Since(start)
	r.mu.Lock()
	r.state = StateRestoring
	r.restoreDuration, r.cpDuration, r.pfxDuration = d, mid.Sub(start), time.Since(mid)
	r.mu.Unlock()
	return nil
}

// Stop keeps what is held: the final checkpoint written after this hook
// then still lists the restored identities nobody took up yet, so a quick
// restart loses none of them.
func (r *Restorer) Stop(cell.HookContext) error { return nil }

// restoreBulk is the job that contributes the prefixes of restored
// identities to the ipcache, after the start hooks. Their identities
// already hold their old numbers, so any owner that upserts one of these
// prefixes meanwhile resolves it to the same identity; and the map keeps
// the old entries, as the ipcache prunes nothing before restoration's
// initializer is done, which happens here.
func (r *Restorer) restoreBulk(ctx context.Context, health cell.Health) error {
	select {
	case <-r.done:
	case <-ctx.Done():
		return nil
	}
	start := time.Now()
	bulk := r.bulkUpdates(r.bulk)
	r.bulk = nil
	failed := countErrors(r.ipc.UpsertBatch(ctx, Owner, bulk), r.log)
	// Whatever happened, the ipcache must become initialized, or stale map
	// entries would never be pruned.
	r.initDone()
	r.prefixesRestored.Add(uint64(len(bulk) - failed))
	r.prefixesFailed.Add(uint64(failed))
	d := time.Since(start)
	r.mu.Lock()
	r.heldPrefixes += len(bulk) - failed
	r.bulkDuration = d
	r.state = StateHolding
	r.releaseAt = time.Now().Add(r.grace)
	restore := r.restoreDuration
	r.mu.Unlock()
	close(r.ready)
	c := r.Counters()
	r.log.Info("Restored local identities and ipcache prefixes",
		"restored", c.Restored, "skipped", c.Skipped, "renumbered", c.Renumbered,
		"prefixes", c.PrefixesRestored, "prefixes-failed", c.PrefixesFailed,
		"map-entries-skipped", c.MapEntriesSharedID+c.MapEntriesOtherLabels,
		"start-hook", restore, "prefixes-duration", d, "grace-period", r.grace)
	if failed > 0 {
		health.Degraded("Some old ipcache prefixes could not be restored", fmt.Errorf("%d prefixes failed", failed))
	} else {
		health.OK("Restored")
	}
	return nil
}

// restoreCheckpoint re-allocates the checkpoint's identities with their old
// numbers, and withholds every other number the state files name.
func (r *Restorer) restoreCheckpoint(ctx context.Context) error {
	res, err := r.cp.Load()
	if errors.Is(err, checkpoint.ErrJournalUnusable) {
		return fmt.Errorf("restoration: %w; move it away or make it writable", err)
	}
	defer r.withholdSeen(res)
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

	var restored int
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
		restored++
	}
	if skipped > maxLoggedSkips || renumbered > maxLoggedSkips {
		r.log.Warn("Checkpoint identities not restored as they were", "skipped", skipped, "renumbered", renumbered)
	}
	r.skipped.Add(uint64(skipped))
	r.renumbered.Add(uint64(renumbered))
	r.restored.Add(uint64(restored))

	r.mu.Lock()
	r.held = held
	r.mu.Unlock()
	return nil
}

// withholdSeen withholds, until the release, the numbers the state files
// and their kept copies name that no restored identity holds: after
// damage, or with a checkpoint older than the journal, some of them were
// answered for label sets restoration could not restore, and giving them
// to another label set while a datapath entry or a peer may still hold
// the old meaning is what restoration exists to prevent. It also reports
// the journal's damage.
func (r *Restorer) withholdSeen(res checkpoint.LoadResult) {
	jr := res.Report.Journal
	var damage *Damage
	if jr.Damage != nil {
		damage = &Damage{Journal: jr.Damage.Error(), KeptAs: jr.KeptAs, Records: jr.Records, Salvaged: jr.Salvaged, LostBytes: jr.LostBytes}
		r.journalSalvaged.Add(uint64(jr.Salvaged))
		r.journalLostBytes.Add(uint64(jr.LostBytes))
	}
	r.mu.Lock()
	held := make(map[identity.NumericIdentity]bool, len(r.held))
	for _, id := range r.held {
		held[id.ID] = true
	}
	r.mu.Unlock()
	var seen []identity.NumericIdentity
	for _, id := range res.Seen {
		if id.HasLocalScope() && !held[id] {
			seen = append(seen, id)
		}
	}
	slices.Sort(seen)
	seen = slices.Compact(seen)
	r.seenWithheld.Store(uint64(len(seen)))
	// A torn last record is what a crash during a write leaves: it was
	// never on disk whole, so never answered. Other damage may have
	// destroyed answered records.
	tornTail := errors.Is(jr.Damage, journal.ErrTorn) && jr.Salvaged == 0
	if (jr.Damage != nil && !tornTail) || res.Report.Corrupt != nil {
		unknown := unknownNumbers(res.Seen, held)
		r.unknownWithheld.Store(uint64(len(unknown)))
		seen = append(seen, unknown...)
	}
	r.alloc.Withhold(seen)
	r.mu.Lock()
	r.seen = seen
	r.journalDamage = damage
	r.copiesRead = res.Report.CopiesRead
	r.mu.Unlock()
	if damage != nil || len(seen) > 0 {
		r.log.Warn("State files name numbers restoration did not give back, or damage hid which numbers were answered: withholding them until the grace period ends",
			"withheld-named", r.seenWithheld.Load(), "withheld-unknown", r.unknownWithheld.Load(), "journal-damage", jr.Damage, "journal-records", jr.Records,
			"journal-salvaged", jr.Salvaged, "journal-lost-bytes", jr.LostBytes, "kept-copies-read", res.Report.CopiesRead,
			"grace-period", r.grace)
	}
}

// restorePrefixes re-creates ipcache metadata for the prefixes of the old
// map whose identity was node-local, so that they get the same identity
// and the reconciler neither prunes nor changes their entries. Prefixes of
// unknown label sets are done here, before any other cell could upsert
// them with a fresh identity; those of restored identities are returned
// for restoreBulk.
func (r *Restorer) restorePrefixes(ctx context.Context) (bulk []ipcache.MapEntry) {
	snap := r.ipc.TakeSnapshot()
	r.mu.Lock()
	r.oldMapEntries = len(snap)
	r.mapJournalDamage = r.ipc.JournalDamage()
	r.mu.Unlock()

	// Other entries (global identities, tunnelled endpoints, remote
	// clusters) are re-created by their owners, which know them better.
	// The allocator holds only restored local identities at this point,
	// so a local number it knows is one the checkpoint restored.
	bulk = snap[:0]
	var unknown, contradicting []ipcache.MapEntry
	shared := map[identity.NumericIdentity]int{}
	// owned holds the restored IDs the map gives the prefix their CIDR
	// labels name.
	owned := map[identity.NumericIdentity]bool{}
	for _, e := range snap {
		if !restorable(e) {
			continue
		}
		id := e.Value.Identity
		if id != identity.ReservedIdentityIngress {
			if ident := r.alloc.LookupByID(id); ident != nil {
				switch namesPrefix(ident.Labels, e.Key.Prefix) {
				case cidrOther:
					// The checkpoint gives the ID to another prefix's
					// CIDR label set, and the checkpoint wins: restoring
					// the entry would give two prefixes one ID, and this
					// prefix's owner the other prefix's number.
					contradicting = append(contradicting, e)
					continue
				case cidrThis:
					owned[id] = true
				}
				bulk = append(bulk, e)
				continue
			}
		}
		unknown = append(unknown, e)
		if id != identity.ReservedIdentityIngress {
			shared[id]++
		}
	}
	r.skipContradicting(contradicting, owned)
	if len(unknown) == 0 {
		return bulk
	}

	now := make([]ipcache.Update, len(unknown))
	for i, e := range unknown {
		id := e.Value.Identity
		now[i].Prefix = e.Key.Prefix
		switch {
		case id == identity.ReservedIdentityIngress:
			// Ingress is reserved: only a direct identity keeps it.
			now[i].Info.Identity = id
		case shared[id] > 1:
			// Several prefixes shared the ID: each would get its own
			// CIDR label set, so only one could have the number. A
			// direct identity keeps it for all.
			now[i].Info.Identity = id
		default:
			// The labels are unknown (the checkpoint is older than the
			// map, or gone): ask for the old number.
			now[i].Info.RequestedID = id
		}
	}
	// Unknown numbers are withheld until the release, so that nothing
	// else takes them while their prefixes may still use them.
	withheld := make([]identity.NumericIdentity, 0, len(shared))
	for id := range shared {
		withheld = append(withheld, id)
	}
	slices.Sort(withheld)
	r.alloc.Withhold(withheld)
	r.mu.Lock()
	r.withheld = withheld
	r.mu.Unlock()

	failed := countErrors(r.ipc.UpsertBatch(ctx, Owner, now), r.log)

	// A requested ID is not honoured when the prefix's CIDR label set
	// already has another identity; pin those prefixes to their number.
	var fix []ipcache.Update
	for _, u := range now {
		if u.Info.RequestedID == 0 {
			continue
		}
		if e, ok := r.ipc.LookupPrefix(u.Prefix); ok && e.Identity != u.Info.RequestedID {
			fix = append(fix, ipcache.Update{Prefix: u.Prefix, Info: ipcache.Info{Identity: u.Info.RequestedID}})
		}
	}
	if len(fix) > 0 {
		r.log.Warn("Old prefix identities not available, keeping them as direct identities", "prefixes", len(fix))
		failed += countErrors(r.ipc.UpsertBatch(ctx, Owner, fix), r.log)
	}

	r.prefixesRestored.Add(uint64(len(now) - failed))
	r.prefixesFailed.Add(uint64(failed))
	r.mu.Lock()
	r.heldPrefixes = len(now) - failed
	r.mu.Unlock()
	return bulk
}

// skipContradicting logs and counts the old map entries skipped because
// their ID belongs to another prefix's CIDR label set. The prefixes stay out
// of the ipcache until their owners upsert them again, which gives each the
// checkpoint's number for its own label set (or a fresh one); the map loses
// the wrong entries when the ipcache prunes it.
func (r *Restorer) skipContradicting(entries []ipcache.MapEntry, owned map[identity.NumericIdentity]bool) {
	var sharedID, otherLabels uint64
	for i, e := range entries {
		id := e.Value.Identity
		reason := "its ID belongs to another prefix's label set"
		if owned[id] {
			sharedID++
			reason = "its ID belongs to another prefix of the map"
		} else {
			otherLabels++
		}
		if i < maxLoggedSkips {
			var lbls labels.Labels
			if ident := r.alloc.LookupByID(id); ident != nil {
				lbls = ident.Labels
			}
			r.log.Warn("Skipping old ipcache map entry that contradicts the checkpoint",
				"prefix", e.Key.Prefix, "identity", id, "checkpoint-labels", lbls, "reason", reason)
		}
	}
	if len(entries) > maxLoggedSkips {
		r.log.Warn("Old ipcache map entries skipped because they contradict the checkpoint",
			"shared-id", sharedID, "other-labels", otherLabels)
	}
	r.mapSharedID.Add(sharedID)
	r.mapOtherLabels.Add(otherLabels)
}

// unknownMargin is how far above the highest number the state files name
// restoration withholds numbers after damage: local numbers are handed out
// upwards from a cursor, so the answers whose records were lost (an empty
// journal, a cut or overwritten range) took numbers in the gaps below the
// highest one seen or just above it.
const unknownMargin = 1 << 16

// unknownNumbers returns, for each local scope, every number from the
// scope's first up to unknownMargin above the highest one seen, except
// those held: after damage, any of them may have been answered.
func unknownNumbers(seen []identity.NumericIdentity, held map[identity.NumericIdentity]bool) []identity.NumericIdentity {
	var out []identity.NumericIdentity
	for _, scope := range []identity.Scope{identity.ScopeLocal, identity.ScopeRemoteNode} {
		top := identity.MinLocalIdentity
		for _, id := range seen {
			if id.Scope() == scope {
				top = max(top, id&^identity.ScopeMask)
			}
		}
		hi := identity.NumericIdentity(min(uint64(top)+unknownMargin, uint64(identity.MaxLocalIdentity)))
		for c := identity.MinLocalIdentity; c <= hi; c++ {
			if id := identity.NumericIdentity(scope) | c; !held[id] {
				out = append(out, id)
			}
		}
	}
	return out
}

// cidrMatch says whether a label set's CIDR labels name a prefix.
type cidrMatch int

const (
	// cidrNone: the label set has no CIDR label (e.g. FQDN labels only),
	// so that several prefixes may share its identity.
	cidrNone cidrMatch = iota
	// cidrThis: a CIDR label names the prefix.
	cidrThis
	// cidrOther: the CIDR labels name other prefixes only.
	cidrOther
)

// namesPrefix tells whether lbls is a label set of prefix p as far as its
// CIDR labels go: the ipcache gives every prefix with metadata its own
// CIDR label, so an identity whose CIDR labels name other prefixes cannot
// be p's.
func namesPrefix(lbls labels.Labels, p netip.Prefix) cidrMatch {
	key := labels.CIDRKey(p)
	m := cidrNone
	for _, l := range lbls {
		if l.Source != labels.SourceCIDR {
			continue
		}
		if l.Key == key {
			return cidrThis
		}
		m = cidrOther
	}
	return m
}

// bulkUpdates turns the prefixes of restored identities into ipcache
// contributions.
func (r *Restorer) bulkUpdates(entries []ipcache.MapEntry) []ipcache.Update {
	out := make([]ipcache.Update, len(entries))
	for i, e := range entries {
		id := e.Value.Identity
		out[i].Prefix = e.Key.Prefix
		ident := r.alloc.LookupByID(id)
		if ident != nil && r.mergesTo(e.Key.Prefix, ident.Labels) {
			// The ipcache adds the prefix's CIDR labels to these, which
			// gives back the restored label set and so its identity.
			out[i].Info.Labels = ident.Labels
			continue
		}
		// The label set does not derive from the prefix (e.g. FQDN
		// labels): keep the number as is. The restorer's reference keeps
		// the identity alive.
		out[i].Info.Identity = id
	}
	return out
}

// restorable tells whether an old map entry is restoration's business: a
// prefix of this cluster with a node-local (or the ingress) identity and no
// tunnel endpoint.
func restorable(e ipcache.MapEntry) bool {
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
	case <-r.ready:
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
	case <-r.ready:
	case <-ctx.Done():
		return ctx.Err()
	}
	start := time.Now()
	r.mu.Lock()
	if r.releasing {
		r.mu.Unlock()
		return nil
	}
	r.releasing = true
	held, withheld := r.held, append(r.withheld, r.seen...)
	r.held, r.withheld, r.seen, r.heldPrefixes = nil, nil, nil, 0
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
	idStart := time.Now()
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
	idDuration := time.Since(idStart)
	r.releasedAfterGrace.Add(freed)
	d := time.Since(start)
	r.mu.Lock()
	r.state = StateReleased
	r.releaseDuration, r.releaseIDsDuration = d, idDuration
	r.mu.Unlock()
	err = errors.Join(errs...)
	r.log.Info("Released restored identities and ipcache prefixes",
		"identities", len(held), "freed", freed, "prefixes", prefixes,
		"unwithheld", len(withheld), "duration", d, "error", err)
	return err
}
