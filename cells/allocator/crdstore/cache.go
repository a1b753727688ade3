package crdstore

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/client-go/tools/cache"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/idprobe"
	"github.com/identityd/identityd/internal/logtext"
	"github.com/identityd/identityd/labels"
)

// entry is one CiliumIdentity object of the cache, parsed. The object is
// the one the watch delivered; nothing modifies it.
type entry struct {
	id   identity.NumericIdentity
	key  string // canonical labels
	lbls labels.Labels
	obj  *CiliumIdentity
	// placed: identityd created the object (createdByIdentityd).
	placed bool
}

// createdByIdentityd reports whether identityd created obj: its
// managedFields name identityd's fieldManager as an owner of the
// security-labels, which no writer changes after the create.
func createdByIdentityd(obj *CiliumIdentity) bool {
	for _, mf := range obj.ManagedFields {
		if mf.Manager == fieldManager && mf.FieldsV1 != nil && bytes.Contains(mf.FieldsV1.Raw, []byte(`"f:security-labels"`)) {
			return true
		}
	}
	return false
}

func (e *entry) marked() bool {
	_, ok := e.obj.Annotations[HeartbeatAnnotation]
	return ok
}

type change struct {
	upsert bool
	id     identity.NumericIdentity
	lbls   labels.Labels
}

// cacheHooks let the store react to the cache's changes.
type cacheHooks struct {
	// emit reports changes, in order, outside the cache's lock.
	emit func([]change)
	// marked runs, outside the lock, for every object that arrives with
	// the heartbeat mark.
	marked func(id identity.NumericIdentity, lbls labels.Labels)
	// synced runs once, after the first complete listing.
	synced func()
	// split runs, outside the lock, after a change to the objects of a
	// label set that has, or had, more than one.
	split func()
}

// identityCache is the list+watch cache of the CiliumIdentity objects of
// this cluster's range, indexed by ID and by canonical labels. A
// client-go Reflector feeds it (it implements cache.ReflectorStore): one
// listing, then a watch from the listing's resourceVersion, and a new
// listing after a 410 Gone, of which only the differences are reported.
// Events arrive from one goroutine, in the API server's order, so the
// cache is a consistent prefix of the server's history.
type identityCache struct {
	log *slog.Logger
	// rng is the part of the cluster's range the store places and
	// collects identities in: the whole range, except in tests that
	// narrow it (idRange).
	rng   idRange
	hooks cacheHooks

	mu    sync.RWMutex
	byID  map[identity.NumericIdentity]*entry
	byKey map[string][]*entry
	// ignored holds, by name, the resourceVersion of every object left
	// out (a name that is not an ID of this cluster's range, labels that
	// do not parse), so that each version is logged and counted once.
	ignored map[string]string
	waiters map[identity.NumericIdentity][]chan struct{}

	ignoredTotal atomic.Uint64
	splitsTotal  atomic.Uint64
	// foreignSplits counts the splits of which identityd's walk did not
	// place every object (splits.go).
	foreignSplits atomic.Uint64
	// splitKeys counts the label sets that have more than one object now;
	// multi holds them (under mu), and multiChanged says that one of them
	// changed since the split hook last ran.
	splitKeys    atomic.Int64
	multi        map[string]struct{}
	multiChanged atomic.Bool

	synced chan struct{}
	once   sync.Once

	// gate, when set (by tests), holds the watch's events until it is
	// closed: a watch that is behind.
	gate atomic.Pointer[chan struct{}]
}

// passGate waits while a test holds the watch's events.
func (c *identityCache) passGate() {
	if g := c.gate.Load(); g != nil {
		<-*g
	}
}

var _ cache.ReflectorStore = (*identityCache)(nil)

// idRange is the IDs lo..hi the store places identities in and collects:
// the cluster's range. Tests of a full range narrow it (the unexported
// rng of the store's cache, set before the store starts), so that it fills with a few
// hundred objects instead of the range's tens of thousands; nothing else
// sets it.
type idRange struct{ lo, hi identity.NumericIdentity }

// clusterRange is the whole range of cluster.
func clusterRange(cluster identity.ClusterInfo) idRange {
	return idRange{lo: cluster.MinID(), hi: cluster.MaxID()}
}

func (r idRange) contains(id identity.NumericIdentity) bool { return id >= r.lo && id <= r.hi }

// size is the number of IDs of the range.
func (r idRange) size() uint64 { return uint64(r.hi) - uint64(r.lo) + 1 }

// probe is the probe sequence of the label set whose canonical string is
// key over the range.
func (r idRange) probe(key string) idprobe.Sequence { return idprobe.NewRange(key, r.lo, r.hi) }

func newIdentityCache(log *slog.Logger, cluster identity.ClusterInfo, hooks cacheHooks) *identityCache {
	return &identityCache{
		log:     log,
		rng:     clusterRange(cluster),
		hooks:   hooks,
		byID:    map[identity.NumericIdentity]*entry{},
		byKey:   map[string][]*entry{},
		ignored: map[string]string{},
		multi:   map[string]struct{}{},
		waiters: map[identity.NumericIdentity][]chan struct{}{},
		synced:  make(chan struct{}),
	}
}

// parse checks an object: its name must be the decimal form of an ID of
// this cluster's range, its security-labels a valid label set.
func (c *identityCache) parse(obj *CiliumIdentity) (*entry, error) { return parseEntry(c.rng, obj) }

// parseEntry is parse over the range rng.
func parseEntry(rng idRange, obj *CiliumIdentity) (*entry, error) {
	id, err := parseName(obj.Name)
	if err != nil {
		return nil, err
	}
	if !rng.contains(id) {
		return nil, fmt.Errorf("ID %d is outside this cluster's range %d..%d", id, rng.lo, rng.hi)
	}
	lbls, err := parseSecurityLabels(obj.SecurityLabels)
	if err != nil {
		return nil, err
	}
	return &entry{id: id, key: lbls.Canonical(), lbls: lbls, obj: obj, placed: createdByIdentityd(obj)}, nil
}

// parseName reads an object name as a numeric identity: decimal digits
// only, without sign or leading zeros, so that one ID has one name.
func parseName(name string) (identity.NumericIdentity, error) {
	v, err := strconv.ParseUint(name, 10, 32)
	if err != nil || name == "" || (name[0] == '0') || strconv.FormatUint(v, 10) != name {
		return 0, fmt.Errorf("name %q is not a numeric identity", name)
	}
	return identity.NumericIdentity(v), nil
}

// ignore logs and counts an object left out, once per resourceVersion.
// Under mu.
func (c *identityCache) ignore(obj *CiliumIdentity, err error) {
	if c.ignored[obj.Name] == obj.ResourceVersion {
		return
	}
	c.ignored[obj.Name] = obj.ResourceVersion
	c.ignoredTotal.Add(1)
	c.log.Debug("Ignoring CiliumIdentity object", "name", logtext.Cap(obj.Name), "resourceVersion", obj.ResourceVersion, "error", logtext.Error(err))
}

// Add implements cache.ReflectorStore.
func (c *identityCache) Add(obj any) error { return c.Update(obj) }

// Update implements cache.ReflectorStore.
func (c *identityCache) Update(obj any) error {
	c.passGate()
	ci, ok := obj.(*CiliumIdentity)
	if !ok {
		return fmt.Errorf("unexpected object %T in the CiliumIdentity watch", obj)
	}
	var changes []change
	var mark *entry
	c.mu.Lock()
	e, err := c.parse(ci)
	if err != nil {
		c.ignore(ci, err)
		// A name that held a valid object before holds none now.
		if id, perr := parseName(ci.Name); perr == nil {
			if old := c.byID[id]; old != nil {
				changes = append(changes, c.remove(old))
			}
		}
	} else {
		delete(c.ignored, ci.Name)
		changes = c.store(e, changes)
		if e.marked() {
			mark = e
		}
	}
	c.mu.Unlock()
	c.report(changes)
	if mark != nil && c.hooks.marked != nil {
		c.hooks.marked(mark.id, mark.lbls)
	}
	return nil
}

// Delete implements cache.ReflectorStore.
func (c *identityCache) Delete(obj any) error {
	c.passGate()
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	ci, ok := obj.(*CiliumIdentity)
	if !ok {
		return fmt.Errorf("unexpected object %T in the CiliumIdentity watch", obj)
	}
	var changes []change
	c.mu.Lock()
	delete(c.ignored, ci.Name)
	if id, err := parseName(ci.Name); err == nil {
		if old := c.byID[id]; old != nil {
			changes = append(changes, c.remove(old))
		}
	}
	c.mu.Unlock()
	c.report(changes)
	return nil
}

// Replace implements cache.ReflectorStore: a complete listing, after which
// only what differs from the cache is reported.
func (c *identityCache) Replace(list []any, _ string) error {
	fresh := make(map[identity.NumericIdentity]*CiliumIdentity, len(list))
	var objs []*CiliumIdentity
	for _, o := range list {
		ci, ok := o.(*CiliumIdentity)
		if !ok {
			return fmt.Errorf("unexpected object %T in the CiliumIdentity listing", o)
		}
		objs = append(objs, ci)
	}
	var changes []change
	var marks, parsed []*entry
	c.mu.Lock()
	ignored := c.ignored
	c.ignored = map[string]string{}
	for _, ci := range objs {
		e, err := c.parse(ci)
		if err != nil {
			if ignored[ci.Name] == ci.ResourceVersion {
				c.ignored[ci.Name] = ci.ResourceVersion
			} else {
				c.ignore(ci, err)
			}
			continue
		}
		fresh[e.id] = ci
		parsed = append(parsed, e)
	}
	// Removals first, so that a label set that moved to another ID
	// meanwhile is not counted as split.
	for id, old := range c.byID {
		if _, ok := fresh[id]; !ok {
			changes = append(changes, c.remove(old))
		}
	}
	for _, e := range parsed {
		changes = c.store(e, changes)
		if e.marked() {
			marks = append(marks, e)
		}
	}
	c.mu.Unlock()
	c.report(changes)
	for _, e := range marks {
		if c.hooks.marked != nil {
			c.hooks.marked(e.id, e.lbls)
		}
	}
	c.once.Do(func() {
		close(c.synced)
		if c.hooks.synced != nil {
			c.hooks.synced()
		}
	})
	return nil
}

// Resync implements cache.ReflectorStore; there is nothing to resync.
func (c *identityCache) Resync() error { return nil }

// Bookmark implements cache.ReflectorBookmarkStore. The cache keeps no
// resourceVersion (nothing reads one); a bookmark waits at the test's gate
// as the watch's other events do.
func (c *identityCache) Bookmark(string) error {
	c.passGate()
	return nil
}

// store puts e in the cache, replacing the object of its ID, and appends
// what changed for the allocator. Under mu.
func (c *identityCache) store(e *entry, changes []change) []change {
	old := c.byID[e.id]
	if old != nil && old.key == e.key {
		c.byID[e.id] = e
		es := c.byKey[e.key]
		for i := range es {
			if es[i] == old {
				es[i] = e
			}
		}
		c.wake(e.id)
		return changes
	}
	if old != nil {
		changes = append(changes, c.remove(old))
	}
	c.byID[e.id] = e
	es := append(c.byKey[e.key], e)
	c.byKey[e.key] = es
	if len(es) >= 2 {
		c.multi[e.key] = struct{}{}
		c.multiChanged.Store(true)
	}
	if len(es) == 2 {
		c.splitsTotal.Add(1)
		c.splitKeys.Add(1)
		c.reportDuplicateLocked(e.key, es)
	}
	c.wake(e.id)
	return append(changes, change{upsert: true, id: e.id, lbls: e.lbls})
}

// remove takes e out of the cache and returns the change. Under mu.
func (c *identityCache) remove(e *entry) change {
	delete(c.byID, e.id)
	es := c.byKey[e.key]
	for i := range es {
		if es[i] == e {
			es = append(es[:i:i], es[i+1:]...)
			break
		}
	}
	if len(es) == 1 {
		c.splitKeys.Add(-1)
		delete(c.multi, e.key)
	}
	if len(es) >= 1 {
		// It had more than one.
		c.multiChanged.Store(true)
	}
	if len(es) == 0 {
		delete(c.byKey, e.key)
	} else {
		c.byKey[e.key] = es
	}
	return change{id: e.id, lbls: e.lbls}
}

func (c *identityCache) report(changes []change) {
	if len(changes) > 0 && c.hooks.emit != nil {
		c.hooks.emit(changes)
	}
	if c.multiChanged.Swap(false) && c.hooks.split != nil {
		c.hooks.split()
	}
}

// splits returns, for every label set with more than one object, the
// rule's pick and the other objects' IDs.
func (c *identityCache) splits() map[string]splitObjects {
	c.mu.RLock()
	defer c.mu.RUnlock()
	out := make(map[string]splitObjects, len(c.multi))
	for key := range c.multi {
		pick := c.pickLocked(key, c.byKey[key])
		if pick == nil {
			continue
		}
		so := splitObjects{pick: pick.id, lbls: pick.lbls}
		for _, e := range c.byKey[key] {
			if e != pick {
				so.others = append(so.others, e.id)
			}
		}
		out[key] = so
	}
	return out
}

// splitObjects are the objects of a label set with more than one.
type splitObjects struct {
	pick   identity.NumericIdentity
	lbls   labels.Labels
	others []identity.NumericIdentity
}

// wake ends the waits for id. Under mu.
func (c *identityCache) wake(id identity.NumericIdentity) {
	for _, ch := range c.waiters[id] {
		close(ch)
	}
	delete(c.waiters, id)
}

// waitFor returns the object of id once the cache has one, waiting at most
// d; nil when none arrived.
func (c *identityCache) waitFor(ctx context.Context, id identity.NumericIdentity, d time.Duration) *entry {
	c.mu.Lock()
	if e := c.byID[id]; e != nil {
		c.mu.Unlock()
		return e
	}
	ch := make(chan struct{})
	c.waiters[id] = append(c.waiters[id], ch)
	c.mu.Unlock()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ch:
	case <-t.C:
	case <-ctx.Done():
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if ws := c.waiters[id]; len(ws) > 0 {
		for i := range ws {
			if ws[i] == ch {
				ws = append(ws[:i:i], ws[i+1:]...)
				break
			}
		}
		if len(ws) == 0 {
			delete(c.waiters, id)
		} else {
			c.waiters[id] = ws
		}
	}
	return c.byID[id]
}

// isSynced reports whether the first listing completed.
func (c *identityCache) isSynced() bool {
	select {
	case <-c.synced:
		return true
	default:
		return false
	}
}

// fill is the share of the range the cache shows held.
func (c *identityCache) fill() float64 {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return float64(len(c.byID)) / float64(c.rng.size())
}

// full reports whether the cache shows every ID of the range held: a walk
// would find no free slot.
func (c *identityCache) full() bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return uint64(len(c.byID)) >= c.rng.size()
}

// scan goes along p from position from, under one lock, to the first slot
// the cache shows free or held by key's object, and returns its position
// and object (nil: free), appending to stepped the marked objects of other
// label sets it passes. ok is false when every slot from there on is
// held by other label sets.
func (c *identityCache) scan(p idprobe.Sequence, from uint64, key string, stepped []*entry) (pos uint64, e *entry, _ []*entry, ok bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	for i := from; i < p.Len(); i++ {
		e := c.byID[p.Slot(i)]
		if e == nil || e.key == key {
			return i, e, stepped, true
		}
		if e.obj != nil && e.marked() {
			stepped = append(stepped, e)
		}
	}
	return 0, nil, stepped, false
}

// dependsOn reads, under one lock, what a create of key's object at
// position pos of p depends on: the slots before pos, each held by
// another label set. ok is false when the cache shows one of them the
// set's own, or an object of the set at pos, or one identityd placed
// anywhere: the walk that is about to create must look again (recheck).
// A slot the cache shows free is not a reason: the walk found it held at
// the server (an object the cache leaves out, or another walk of this
// node creating there), and an object it stepped over is not deleted
// before the create (docs/crd-store.md). marked holds the objects before
// pos that carry the heartbeat mark.
func (c *identityCache) dependsOn(p idprobe.Sequence, pos uint64, key string) (marked []*entry, ok bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	for _, e := range c.byKey[key] {
		if k, on := p.Position(e.id); e.placed || (on && k <= pos) {
			return nil, false
		}
	}
	for i := range pos {
		e := c.byID[p.Slot(i)]
		if e == nil {
			continue
		}
		if e.key == key {
			return nil, false
		}
		if e.obj != nil && e.marked() {
			marked = append(marked, e)
		}
	}
	return marked, true
}

// anyMarkedBefore reports whether an object among the first limit
// positions of p carries a heartbeat mark written before since: only then
// can a walk take such an identity's slot (reclaim).
func (c *identityCache) anyMarkedBefore(p idprobe.Sequence, limit uint64, since time.Time) bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	for i := range min(limit, p.Len()) {
		e := c.byID[p.Slot(i)]
		if e == nil || e.obj == nil || !e.marked() {
			continue
		}
		if at, err := time.Parse(time.RFC3339Nano, e.obj.Annotations[HeartbeatAnnotation]); err != nil || at.Before(since) {
			return true
		}
	}
	return false
}

func (c *identityCache) get(id identity.NumericIdentity) *entry {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.byID[id]
}

// The rule that picks one object among a label set's objects (pickLocked)
// gives the objects identityd's walks place a head start over the others.
const (
	// seqReach is how far along its label set's probe sequence an object
	// counts as placed on it: identityd's walk puts an object at the
	// first slot that is free or the set's, which in a range less than
	// half full is within the first few; a Cilium agent's random ID is
	// there once in about a thousand.
	seqReach = 64
	// walkHeadStart is how much earlier than its creation an object
	// identityd placed (on the sequence, or created by identityd: a
	// migration's object at etcd's ID) counts as created, against the
	// others. It exceeds the time from an object's creationTimestamp to
	// its visibility (the API server's write to etcd), so that a Cilium
	// agent's object that a node sees only after the object on the
	// sequence cannot overturn what that node answered.
	walkHeadStart = 30 * time.Second
	// maxCacheLag is how far behind the API server a node's cache may
	// be, its write of an object included (docs/crd-store.md): an object
	// created earlier is in the cache.
	maxCacheLag = time.Minute
)

// lookup returns the label set's identity by the rule of the design
// (pickLocked). Every node whose cache holds the same objects of the set
// picks the same one, whatever else it holds.
func (c *identityCache) lookup(key string) *entry {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.pickLocked(key, c.byKey[key])
}

// pickSettled is lookup, and tells whether no object the cache does not
// show yet can overturn the pick: either the cache shows the object the
// walk of the set's probe sequence reaches first, so it shows every
// object that became visible before it, and one that became visible
// after was created too late to win (walkHeadStart); or the pick ranks
// before anything created since maxCacheLag before now.
func (c *identityCache) pickSettled(key string, now time.Time) (*entry, bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	pick := c.pickLocked(key, c.byKey[key])
	if pick == nil {
		return nil, false
	}
	if c.walkFirstLocked(key) != nil {
		return pick, true
	}
	ranked, _ := c.rankLocked(pick)
	// rank counts whole seconds: one more for the truncation.
	return pick, ranked.Add(maxCacheLag + time.Second).Before(now)
}

// objectCount is the number of objects of the label set of key.
func (c *identityCache) objectCount(key string) int {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return len(c.byKey[key])
}

// outranksNew reports whether e ranks before any object of its label set
// created from now on, wherever on the sequence: a second for the
// truncation of creationTimestamp, and one for the difference of the
// node's clock and the API server's.
func (c *identityCache) outranksNew(e *entry, now time.Time) bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	at, _ := c.rankLocked(e)
	return at.Add(walkHeadStart + 2*time.Second).Before(now)
}

// pickListed applies the rule to es, the objects of key a listing
// returned.
func (c *identityCache) pickListed(key string, es []*entry) *entry {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.pickLocked(key, es)
}

// pickLocked is pickOn over the cache's range. Under mu.
func (c *identityCache) pickLocked(key string, es []*entry) *entry { return pickOn(c.rng, key, es) }

// pickOn applies the rule to es, the objects of key. A label set has
// more than one object where a writer that does not follow the placement
// (a Cilium agent, a migration) created one. The pick is the object of
// the earliest rank: its creation second, less walkHeadStart for an object
// within seqReach of the start of the set's probe sequence or created by
// identityd (createdByIdentityd); of the same rank, the one earliest on
// the sequence. The rank depends on the object
// alone, never on the cache's other objects, so nodes whose caches differ
// elsewhere pick alike, and an object created later than walkHeadStart
// after the pick cannot overturn it. PickIdentity gives it to the tools
// that read the objects outside a store.
func pickOn(rng idRange, key string, es []*entry) *entry {
	if len(es) <= 1 {
		if len(es) == 0 {
			return nil
		}
		return es[0]
	}
	p := rng.probe(key)
	var (
		pick    *entry
		pickAt  time.Time
		pickPos uint64
	)
	for _, e := range es {
		at, pos := rank(p, e)
		if pick == nil || at.Before(pickAt) || (at.Equal(pickAt) && pos < pickPos) {
			pick, pickAt, pickPos = e, at, pos
		}
	}
	return pick
}

// rankLocked is rank on the probe sequence of e's label set. Under mu.
func (c *identityCache) rankLocked(e *entry) (time.Time, uint64) {
	return rank(c.rng.probe(e.key), e)
}

// rank is e's place in the rule's order on p, its label set's probe
// sequence: the time it counts as created, then its position.
func rank(p idprobe.Sequence, e *entry) (at time.Time, pos uint64) {
	pos, ok := p.Position(e.id)
	if !ok {
		pos = p.Len()
	}
	at = e.created()
	if pos < seqReach || e.placed {
		at = at.Add(-walkHeadStart)
	}
	return at, pos
}

// walkFirstLocked returns the first object of key the walk of its probe
// sequence reaches before a free slot, or nil. Under mu.
func (c *identityCache) walkFirstLocked(key string) *entry {
	p := c.rng.probe(key)
	for i := uint64(0); i < p.Len(); i++ {
		e := c.byID[p.Slot(i)]
		if e == nil {
			return nil
		}
		if e.key == key {
			return e
		}
	}
	return nil
}

// created is the object's creation time, in the whole seconds the API
// server keeps.
func (e *entry) created() time.Time {
	if e.obj == nil {
		return time.Time{}
	}
	return e.obj.CreationTimestamp.Time.Truncate(time.Second)
}

// snapshot returns the cache's objects, in no order, and the IDs of this
// cluster's range held by objects it leaves out (security-labels that do
// not parse), read under one lock: a state the API server had, as the
// cache is a consistent prefix of its history. The garbage collection
// decides on it (gc.go, collect).
func (c *identityCache) snapshot() (es []*entry, unparsed []identity.NumericIdentity) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	es = make([]*entry, 0, len(c.byID))
	for _, e := range c.byID {
		es = append(es, e)
	}
	for name := range c.ignored {
		if id, err := parseName(name); err == nil && c.rng.contains(id) && c.byID[id] == nil {
			unparsed = append(unparsed, id)
		}
	}
	return es, unparsed
}
