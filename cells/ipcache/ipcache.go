package ipcache

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/ipcachemap"
	"github.com/identityd/identityd/labels"
)

// Errors of the ipcache. Returned errors wrap these.
var (
	// ErrInvalidPrefix: the prefix is not a valid IP prefix.
	ErrInvalidPrefix = errors.New("invalid prefix")
	// ErrInvalidInfo: the contribution is inconsistent (see Info.Validate).
	ErrInvalidInfo = errors.New("invalid ipcache info")
	// ErrNotStarted: the map is read before the hive started.
	ErrNotStarted = errors.New("ipcache map is not open")
	// ErrInvalidOwner: the ResourceID is empty or unprintable.
	ErrInvalidOwner = errors.New("invalid owner")
	// ErrNotWritten: WaitDurable found a prefix whose write to the
	// datapath map failed; the reconciler retries it, and the pair is not
	// durable until the retry succeeds.
	ErrNotWritten = errors.New("not written to the datapath map")
	// ErrMapInUse: the start failed because another agent holds the
	// datapath map (or its file); two agents on one map would prune each
	// other's entries.
	ErrMapInUse = ipcachemap.ErrInUse
)

// selfInitializer is the table initializer the ipcache holds until
// restoration has finished (Allocator.WaitForRestoration).
const selfInitializer = "ipcache-start"

// Update is one prefix's contribution in a batch.
type Update struct {
	Prefix netip.Prefix
	Info   Info
}

// IPCache maps IP prefixes to security identities: owners contribute
// metadata or direct identities per prefix, the IPCache resolves them into
// the ipcache table, and a reconciler writes the table into the datapath
// map. Every method is safe for concurrent use.
type IPCache struct {
	log       *slog.Logger
	db        *statedb.DB
	table     statedb.RWTable[*Entry]
	alloc     allocator.Allocator
	localSync allocator.LocalIdentitySyncer // nil without a checkpoint
	mapConfig ipcachemap.Config
	dualStack bool
	rec       reconciler.Reconciler[*Entry]

	// mu serializes writers: the resolution of a prefix reads its row,
	// allocates and writes the row back, and two writers of one prefix
	// would each take an allocator reference.
	mu  sync.Mutex
	seq uint64

	// m is the open map, nil before start and after stop.
	m atomic.Pointer[mapHolder]
	// ready is closed once restoration has finished (at once after start
	// in a hive without restoration): the reconciler writes nothing to the
	// map before.
	ready chan struct{}
	// selfDone marks selfInitializer done.
	selfDone func(statedb.WriteTxn)
	// syncNow asks the sync job to persist the map (capacity 1).
	syncNow chan struct{}

	snapMu   sync.Mutex
	snapshot []ipcachemap.Entry
	snapTook bool
	// journalDamage is what the map's journal had of damage at open; nil
	// when it had none.
	journalDamage *MapJournalDamage
}

// MapJournalDamage is what was damaged in the map file's journal (the file
// backend's, --ipcache-map=file) when the map was opened.
type MapJournalDamage struct {
	// Journal is why the journal was not read as a whole continuation of
	// the map file: a damaged record or header, an empty file, another
	// map file than the one read.
	Journal string `json:"journal"`
	// KeptAs is the copy of the damaged journal, if one was kept.
	KeptAs string `json:"kept-as,omitempty"`
	// Records is the number of its records replayed, Salvaged those of
	// them found after the damage, LostBytes its damaged bytes in no
	// record.
	Records   int   `json:"records"`
	Salvaged  int   `json:"salvaged"`
	LostBytes int64 `json:"lost-bytes"`
}

// JournalDamage returns what was damaged in the map's journal when Start
// opened the map, or nil when nothing was (or before start).
func (c *IPCache) JournalDamage() *MapJournalDamage {
	c.snapMu.Lock()
	defer c.snapMu.Unlock()
	return c.journalDamage
}

type mapHolder struct{ ipcachemap.Map }

// mapOrErr returns the open map.
func (c *IPCache) mapOrErr() (ipcachemap.Map, error) {
	h := c.m.Load()
	if h == nil {
		return nil, ErrNotStarted
	}
	return h.Map, nil
}

// Table returns the read-only ipcache table.
func (c *IPCache) Table() statedb.Table[*Entry] { return c.table }

// Lookup returns the row of the longest prefix that contains addr, as the
// datapath would find it. The row must not be modified.
func (c *IPCache) Lookup(addr netip.Addr) (*Entry, bool) {
	e, _, ok := c.table.Get(c.db.ReadTxn(), LPMIndex.Query(addr.Unmap()))
	return e, ok
}

// LookupPrefix returns the row of exactly prefix.
func (c *IPCache) LookupPrefix(prefix netip.Prefix) (*Entry, bool) {
	p, err := normalize(prefix)
	if err != nil {
		return nil, false
	}
	e, _, ok := c.table.Get(c.db.ReadTxn(), PrefixIndex.Query(p))
	return e, ok
}

// List returns every row, sorted by prefix (IPv4 first).
func (c *IPCache) List() []*Entry {
	return statedb.Collect(c.table.All(c.db.ReadTxn()))
}

// ListOwner returns the rows owner contributes to.
func (c *IPCache) ListOwner(owner ResourceID) []*Entry {
	return statedb.Collect(c.table.List(c.db.ReadTxn(), OwnerIndex.Query(owner)))
}

// Upsert sets owner's contribution to prefix, replacing its previous one,
// and resolves the prefix's identity. On error nothing changed.
func (c *IPCache) Upsert(ctx context.Context, owner ResourceID, prefix netip.Prefix, info Info) error {
	return c.UpsertBatch(ctx, owner, []Update{{Prefix: prefix, Info: info}})
}

// UpsertBatch is Upsert for many prefixes: one allocator batch, one table
// write transaction. A prefix that fails (invalid input, allocation error)
// is left as it was; the others are applied, and the error joins every
// failure. When a prefix appears more than once, its last update wins.
func (c *IPCache) UpsertBatch(ctx context.Context, owner ResourceID, updates []Update) error {
	if err := owner.Validate(); err != nil {
		return err
	}
	changes := make([]change, len(updates))
	for i, u := range updates {
		info := u.Info
		changes[i] = change{prefix: u.Prefix, owner: owner, info: &info}
	}
	return c.apply(ctx, changes)
}

// Remove drops owner's contributions to the prefixes. A prefix left
// without contributions leaves the table and releases its identity.
// Prefixes owner does not contribute to are ignored.
func (c *IPCache) Remove(ctx context.Context, owner ResourceID, prefixes ...netip.Prefix) error {
	if err := owner.Validate(); err != nil {
		return err
	}
	changes := make([]change, len(prefixes))
	for i, p := range prefixes {
		changes[i] = change{prefix: p, owner: owner}
	}
	return c.apply(ctx, changes)
}

// RemoveOwner drops every contribution of owner, in one batch found through
// the owner index (no table scan), and returns how many prefixes it had.
func (c *IPCache) RemoveOwner(ctx context.Context, owner ResourceID) (int, error) {
	if err := owner.Validate(); err != nil {
		return 0, err
	}
	var changes []change
	for e := range c.table.List(c.db.ReadTxn(), OwnerIndex.Query(owner)) {
		changes = append(changes, change{prefix: e.Prefix, owner: owner})
	}
	// Rows that appear between the list and the lock are not the owner's
	// business: an owner that removes itself does not upsert meanwhile.
	return len(changes), c.apply(ctx, changes)
}

// change is one owner's new contribution to a prefix; info nil removes it.
type change struct {
	prefix netip.Prefix
	owner  ResourceID
	info   *Info
	// pos is the change's position in its call, for sorting.
	pos int
}

// plan is the resolution of one changed prefix.
type plan struct {
	prefix netip.Prefix
	old    *Entry
	new    *Entry // nil: the row goes away
	req    int    // index into the allocation requests, -1 for none
}

func normalize(p netip.Prefix) (netip.Prefix, error) {
	if !p.IsValid() {
		return p, fmt.Errorf("%w: %v", ErrInvalidPrefix, p)
	}
	// The datapath looks IPv4 packets up as IPv4, so an IPv4-mapped
	// prefix is stored as the IPv4 prefix it stands for.
	if p.Addr().Is4In6() {
		if p.Bits() < 96 {
			return p, fmt.Errorf("%w: %s is IPv4-mapped with fewer than 96 bits", ErrInvalidPrefix, p)
		}
		p = netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
	}
	return p.Masked(), nil
}

func (c *IPCache) apply(ctx context.Context, changes []change) error {
	if len(changes) == 0 {
		return nil
	}
	var errs []error
	// Validate outside the lock.
	valid := changes[:0:0]
	for _, ch := range changes {
		p, err := normalize(ch.prefix)
		if err == nil && ch.info != nil {
			err = ch.info.Validate()
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", ch.prefix, err))
			continue
		}
		ch.prefix = p
		valid = append(valid, ch)
	}
	if len(valid) > 1 {
		// In prefix order, the table's trees are written along paths
		// that are still in the cache, which makes a large batch (a
		// restoration's) several times cheaper than in random order. A
		// later change of the same prefix replaces an earlier one (only
		// one owner per call): the position breaks ties (cheaper than a
		// stable sort), and the last of equal prefixes is kept.
		for i := range valid {
			valid[i].pos = i
		}
		byPrefix := func(a, b change) int {
			if c := a.prefix.Compare(b.prefix); c != 0 {
				return c
			}
			return cmp.Compare(a.pos, b.pos)
		}
		if !slices.IsSortedFunc(valid, byPrefix) {
			slices.SortFunc(valid, byPrefix)
		}
		out := valid[:0]
		for i, ch := range valid {
			if i+1 < len(valid) && valid[i+1].prefix == ch.prefix {
				continue
			}
			out = append(out, ch)
		}
		valid = out
	}

	c.mu.Lock()
	locked := true
	defer func() {
		if locked {
			c.mu.Unlock()
		}
	}()

	rtxn := c.db.ReadTxn()
	plans := make([]plan, 0, len(valid))
	var reqs []allocator.Request
	for _, ch := range valid {
		old, _, _ := c.table.Get(rtxn, PrefixIndex.Query(ch.prefix))
		owners, changed := c.withContribution(old, ch)
		if !changed {
			continue
		}
		pl := plan{prefix: ch.prefix, old: old, req: -1}
		if len(owners) > 0 {
			pl.new, pl.req = c.resolve(ch.prefix, old, owners, &reqs)
		}
		plans = append(plans, pl)
	}

	// Allocate the new identities before anything is released, so that a
	// prefix moving between label sets never leaves an identity without a
	// reference in between.
	var results []allocator.Result
	if len(reqs) > 0 {
		results = c.alloc.AllocateBatch(ctx, reqs)
	}

	wtxn := c.db.WriteTxn(c.table)
	var release []*identity.Identity
	for i := range plans {
		pl := &plans[i]
		if pl.req >= 0 {
			r := results[pl.req]
			if r.Err != nil {
				errs = append(errs, fmt.Errorf("%s: allocate identity for %s: %w", pl.prefix, reqs[pl.req].Labels, r.Err))
				pl.new = nil
				pl.old = nil // nothing changes for this prefix
				continue
			}
			pl.new.held = r.Identity
			pl.new.Identity = r.Identity.ID
			pl.new.Labels = r.Identity.Labels
		}
		if pl.old != nil && pl.old.held != nil && (pl.new == nil || pl.new.held != pl.old.held) {
			release = append(release, pl.old.held)
		}
		if pl.new != nil {
			pl.new.Status = reconciler.StatusPending()
			if _, _, err := c.table.Insert(wtxn, pl.new); err != nil {
				wtxn.Abort()
				// Only a bug can get here; drop what was allocated.
				c.releaseAll(ctx, newlyHeld(plans))
				return fmt.Errorf("insert %s: %w", pl.prefix, err)
			}
		} else if pl.old != nil {
			if _, _, err := c.table.Delete(wtxn, pl.old); err != nil {
				wtxn.Abort()
				c.releaseAll(ctx, newlyHeld(plans))
				return fmt.Errorf("delete %s: %w", pl.prefix, err)
			}
		}
	}
	wtxn.Commit()
	// The rows no longer hold what is released: other writers need not
	// wait for the releases, which wait for the store of global
	// identities (minutes, with etcd gone).
	c.mu.Unlock()
	locked = false

	c.releaseAll(ctx, release)
	return errors.Join(errs...)
}

func newlyHeld(plans []plan) []*identity.Identity {
	var out []*identity.Identity
	for _, pl := range plans {
		if pl.new != nil && pl.new.held != nil && (pl.old == nil || pl.old.held != pl.new.held) {
			out = append(out, pl.new.held)
		}
	}
	return out
}

func (c *IPCache) releaseAll(ctx context.Context, ids []*identity.Identity) {
	for _, id := range ids {
		if _, err := c.alloc.Release(ctx, id); err != nil {
			// The reference is lost for this run; the allocator's own
			// garbage collection (or the next restart) reclaims it.
			c.log.Warn("Cannot release ipcache identity", "identity", id.ID, "error", err)
		}
	}
}

// withContribution returns the owners of the prefix after the change, and
// whether anything changed.
func (c *IPCache) withContribution(old *Entry, ch change) ([]Contribution, bool) {
	var owners []Contribution
	if old != nil {
		owners = old.Owners
	}
	i, found := slices.BinarySearchFunc(owners, ch.owner, func(c Contribution, o ResourceID) int {
		return cmp.Compare(c.Owner, o)
	})
	if ch.info == nil {
		if !found {
			return owners, false
		}
		// Rows are shared with readers: never modify a slice in place.
		return slices.Delete(slices.Clone(owners), i, i+1), true
	}
	if found && infoEqual(owners[i].Info, *ch.info) {
		return owners, false
	}
	c.seq++
	nc := Contribution{Owner: ch.owner, Info: *ch.info, seq: c.seq}
	if found {
		out := slices.Clone(owners)
		out[i] = nc
		return out, true
	}
	out := make([]Contribution, 0, len(owners)+1)
	out = append(out, owners[:i]...)
	out = append(out, nc)
	return append(out, owners[i:]...), true
}

func infoEqual(a, b Info) bool {
	return a.Identity == b.Identity && a.RequestedID == b.RequestedID &&
		a.TunnelEndpoint == b.TunnelEndpoint && a.EncryptKey == b.EncryptKey &&
		a.Labels.Equal(b.Labels)
}

// resolve builds the new row of a prefix from its contributions (see the
// package documentation for the precedence). When the row needs an
// allocation, it appends the request to reqs and returns its index.
func (c *IPCache) resolve(prefix netip.Prefix, old *Entry, owners []Contribution, reqs *[]allocator.Request) (*Entry, int) {
	e := &Entry{Prefix: prefix, Owners: owners}

	// A direct identity wins over metadata; the latest direct upsert
	// wins over older ones.
	var direct *Contribution
	for i := range owners {
		if owners[i].IsDirect() && (direct == nil || owners[i].seq > direct.seq) {
			direct = &owners[i]
		}
	}
	if direct != nil {
		e.Source = SourceDirect
		e.Identity = direct.Identity
		e.TunnelEndpoint = direct.TunnelEndpoint
		e.EncryptKey = direct.EncryptKey
		return e, -1
	}

	lbls, requested := c.mergedLabels(prefix, owners)
	e.Source = SourceMetadata
	if old != nil && old.held != nil && old.Labels.Equal(lbls) {
		// Same label set: keep the reference already held.
		e.held, e.Identity, e.Labels = old.held, old.Identity, old.Labels
		return e, -1
	}
	*reqs = append(*reqs, allocator.Request{Labels: lbls, OldID: requested})
	return e, len(*reqs) - 1
}

// mergedLabels returns the label set of a prefix's metadata and the ID to
// request for it.
func (c *IPCache) mergedLabels(prefix netip.Prefix, owners []Contribution) (labels.Labels, identity.NumericIdentity) {
	cidr := labels.FromPrefix(prefix, c.dualStack)
	var (
		extra     []labels.Labels
		requested identity.NumericIdentity
		reserved  bool
	)
	for _, o := range owners {
		if len(o.Labels) > 0 {
			extra = append(extra, o.Labels)
			for _, l := range o.Labels {
				if l.Source == labels.SourceReserved && !isWorld(l) {
					reserved = true
				}
			}
		} else if requested == 0 {
			requested = o.RequestedID
		}
	}
	if len(extra) == 0 {
		return cidr, requested
	}
	if reserved {
		// A prefix with a reserved role (host, remote-node, …) is not
		// part of the world.
		cidr = slices.DeleteFunc(slices.Clone(cidr), isWorld)
	}
	// Owners are sorted, so a later owner's label wins a key conflict,
	// whatever the order of the upserts.
	return labels.Merge(append([]labels.Labels{cidr}, extra...)...), 0
}

func isWorld(l labels.Label) bool {
	return l == labels.LabelWorld || l == labels.LabelWorldIPv4 || l == labels.LabelWorldIPv6
}

// RegisterInitializer holds back the ipcache table's initialization, and so
// the pruning of stale map entries, until done is called. Call it from a
// constructor (or from restoration's start hook): the table may count as
// initialized as soon as restoration has finished, and right after the
// ipcache's start hook in a hive without restoration.
func (c *IPCache) RegisterInitializer(name string) (done func()) {
	wtxn := c.db.WriteTxn(c.table)
	markDone := c.table.RegisterInitializer(wtxn, name)
	wtxn.Commit()
	return func() {
		wtxn := c.db.WriteTxn(c.table)
		markDone(wtxn)
		wtxn.Commit()
	}
}

// Initialized tells whether the table is initialized, i.e. whether stale
// map entries may be pruned, and returns a channel closed when it is.
func (c *IPCache) Initialized() (bool, <-chan struct{}) {
	return c.table.Initialized(c.db.ReadTxn())
}

// TakeSnapshot hands over the map's contents as found when the map was
// opened, before anything wrote to it, and drops them from memory: a
// second call returns nil. Before start it returns nil too. The
// restoration cell calls it from its start hook.
func (c *IPCache) TakeSnapshot() []MapEntry {
	c.snapMu.Lock()
	s := c.snapshot
	c.snapshot = nil
	c.snapTook = true
	c.snapMu.Unlock()
	return mapEntries(s)
}

// Start opens the map (which snapshots its old contents); the
// waitForRestoration job lets the reconciler write it.
func (c *IPCache) Start(cell.HookContext) error {
	m, info, err := ipcachemap.Open(c.mapConfig)
	if info.MountedBPFFS != "" {
		// Mounting changes the host for every process on it.
		c.log.Info("Mounted bpffs for the ipcache map, none was mounted", "path", info.MountedBPFFS)
	}
	if err != nil {
		return fmt.Errorf("open ipcache map: %w", err)
	}
	for _, w := range info.Warnings {
		c.log.Warn("IPCache map", "warning", w)
	}
	c.log.Info("IPCache map opened",
		"kind", m.Kind(), "path", m.Path(), "reason", info.Reason,
		"old-entries", len(info.Snapshot), "skipped", info.Skipped)
	c.snapMu.Lock()
	if !c.snapTook {
		c.snapshot = info.Snapshot
	}
	if info.JournalDamage != "" {
		c.journalDamage = &MapJournalDamage{
			Journal: info.JournalDamage, KeptAs: info.JournalKeptAs, Records: info.JournalRecords,
			Salvaged: info.JournalSalvaged, LostBytes: info.JournalLostBytes,
		}
	}
	c.snapMu.Unlock()
	c.m.Store(&mapHolder{m})
	return nil
}

// waitForRestoration is the job that lets the reconciler write the map, and
// the table count as initialized, once restoration has finished
// (Allocator.WaitForRestoration; at once in a hive without restoration):
// nothing overwrites an old entry before restoration has re-created its
// prefix. Pruning waits longer, for restoration's own initializer.
func (c *IPCache) waitForRestoration(ctx context.Context, health cell.Health) error {
	health.OK("Waiting for restoration")
	if err := c.alloc.WaitForRestoration(ctx); err != nil {
		// Stopped before restoration finished.
		return nil
	}
	close(c.ready)
	wtxn := c.db.WriteTxn(c.table)
	c.selfDone(wtxn)
	wtxn.Commit()
	return nil
}

// Stop closes the map; the file backend writes its last state. The
// reconciler's jobs have stopped before (job hooks stop first).
func (c *IPCache) Stop(cell.HookContext) error {
	h := c.m.Swap(nil)
	if h == nil {
		return nil
	}
	if err := h.Close(); err != nil {
		return fmt.Errorf("close ipcache map: %w", err)
	}
	return nil
}

// waitReady blocks until the map may be written.
func (c *IPCache) waitReady(ctx context.Context) (ipcachemap.Map, error) {
	select {
	case <-c.ready:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return c.mapOrErr()
}

// WaitForMap blocks until the map holds every row of the table as it is at
// the call, or ctx ends. Rows that fail to reconcile keep it waiting.
func (c *IPCache) WaitForMap(ctx context.Context) error {
	for {
		rev := c.table.Revision(c.db.ReadTxn())
		cur, low, err := c.rec.WaitUntilReconciled(ctx, rev)
		if err != nil {
			return err
		}
		if low == 0 || low > rev {
			return nil
		}
		// A failed row waits for its retry, which commits a new status
		// and so a new revision.
		if _, _, err := c.rec.WaitUntilReconciled(ctx, cur+1); err != nil {
			return err
		}
	}
}

// MapDump returns the map's current entries, sorted by cluster and prefix.
func (c *IPCache) MapDump() ([]MapEntry, error) {
	m, err := c.mapOrErr()
	if err != nil {
		return nil, err
	}
	entries, err := ipcachemap.Snapshot(m)
	if err != nil {
		return nil, err
	}
	out := mapEntries(entries)
	slices.SortFunc(out, func(a, b MapEntry) int {
		if c := cmp.Compare(a.Key.ClusterID, b.Key.ClusterID); c != 0 {
			return c
		}
		if c := a.Key.Prefix.Addr().Compare(b.Key.Prefix.Addr()); c != 0 {
			return c
		}
		return cmp.Compare(a.Key.Prefix.Bits(), b.Key.Prefix.Bits())
	})
	return out, nil
}

// MapKind returns the backend in use (MapKindBPF or MapKindFile), empty
// before start.
func (c *IPCache) MapKind() MapKind {
	if h := c.m.Load(); h != nil {
		return MapKind(h.Kind())
	}
	return ""
}
