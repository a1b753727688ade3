package restoration_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/hive/script"
	"github.com/cilium/hive/script/scripttest"
	"github.com/cilium/statedb"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/checkpoint"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/cells/restoration"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/eventually"
	"github.com/identityd/identityd/internal/ipcachemap"
	"github.com/identityd/identityd/internal/scriptengine"
	"github.com/identityd/identityd/internal/testhive"
)

const testOwner ipcache.ResourceID = "test"

// TestRestart stops an agent and starts a new one on the same state
// directory and map: every prefix keeps its identity and every local
// identity its number; after the grace period, what nobody took up again is
// gone and nothing stays withheld.
func TestRestart(t *testing.T) {
	dir := t.TempDir()
	ctx := context.Background()
	ps := prefixes(300)

	a := newAgent(t, dir, time.Hour, nil)
	a.start(t)
	var ups []ipcache.Update
	for i, p := range ps {
		u := ipcache.Update{Prefix: p}
		if i%50 == 7 {
			// Remote-node scope.
			u.Info.Labels = mustLabels("reserved:remote-node")
		}
		ups = append(ups, u)
	}
	if err := a.ipc.UpsertBatch(ctx, testOwner, ups); err != nil {
		t.Fatal(err)
	}
	// Gaps in the numbering, so that a restart numbering from scratch
	// would not give the same numbers by chance.
	fqdn := mustLabels("fqdn:a.example.com")
	gone := mustLabels("fqdn:gone.example.com")
	if _, _, err := a.alloc.Allocate(ctx, gone); err != nil {
		t.Fatal(err)
	}
	fq, _, err := a.alloc.Allocate(ctx, fqdn)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.alloc.Release(ctx, a.alloc.LookupByLabels(gone)); err != nil {
		t.Fatal(err)
	}
	if err := a.ipc.Remove(ctx, testOwner, ps[0], ps[3]); err != nil {
		t.Fatal(err)
	}
	before := a.mapPairs(t)
	ids := a.localIDs()
	if len(before) != len(ps)-2 || len(ids) != len(ps)-2+1 {
		t.Fatalf("before: %d map entries, %d local identities", len(before), len(ids))
	}
	a.stop(t)

	b := newAgent(t, dir, time.Hour, nil)
	b.start(t)
	if got := b.mapPairs(t); !equalMaps(got, before) {
		t.Fatalf("map differs after restart:\n got %d entries\nwant %d", len(got), len(before))
	}
	if got := b.localIDs(); !equalMaps(got, ids) {
		t.Fatalf("local identities differ after restart")
	}
	st := b.r.Status()
	if st.Counters.Restored != uint64(len(ids)) || st.Counters.PrefixesRestored != uint64(len(before)) ||
		st.Counters.Skipped != 0 || st.State != restoration.StateHolding {
		t.Fatalf("status: %+v", st)
	}
	// Some users come back during the grace period.
	if err := b.ipc.UpsertBatch(ctx, testOwner, ups[100:200]); err != nil {
		t.Fatal(err)
	}
	if _, _, err := b.alloc.Allocate(ctx, fqdn); err != nil {
		t.Fatal(err)
	}
	if err := b.r.Release(ctx); err != nil {
		t.Fatal(err)
	}
	after := b.mapPairs(t)
	if len(after) != 100 {
		t.Fatalf("after release: %d map entries, want 100", len(after))
	}
	for _, u := range ups[100:200] {
		if after[u.Prefix] != before[u.Prefix] {
			t.Fatalf("%s: identity %d after release, %d before", u.Prefix, after[u.Prefix], before[u.Prefix])
		}
	}
	if got := b.localIDs(); len(got) != 101 || got[fqdn.Canonical()] != fq.ID {
		t.Fatalf("after release: %d local identities, fqdn %d (want 101, %d)", len(got), got[fqdn.Canonical()], fq.ID)
	}
	if w := b.alloc.Withheld(); len(w) != 0 {
		t.Fatalf("withheld after release: %v", w)
	}
	st = b.r.Status()
	if st.State != restoration.StateReleased || st.HeldIdentities != 0 || st.Counters.ReleasedAfterGrace != uint64(len(ids)-101) {
		t.Fatalf("status after release: %+v", st)
	}
	b.stop(t)
}

// TestRestartStaleCheckpoint restarts with a checkpoint older than the map
// (as after SIGKILL): the map's prefixes keep their identities through
// requested IDs, which stay withheld until the grace period ends.
func TestRestartStaleCheckpoint(t *testing.T) {
	dir := t.TempDir()
	ctx := context.Background()
	ps := prefixes(100)

	a := newAgent(t, dir, time.Hour, nil)
	a.start(t)
	if err := a.ipc.UpsertBatch(ctx, testOwner, updates(ps[:50])); err != nil {
		t.Fatal(err)
	}
	if _, err := a.cp.Write(); err != nil {
		t.Fatal(err)
	}
	if err := a.ipc.UpsertBatch(ctx, testOwner, updates(ps[50:])); err != nil {
		t.Fatal(err)
	}
	before := a.mapPairs(t)
	a.stop(t)
	// Put the older checkpoint back, as if the final write never happened.
	cpFile := filepath.Join(dir, checkpoint.FileName)
	res, err := (checkpoint.Loader{}).Load(cpFile)
	if err != nil || len(res.Identities) != 100 {
		t.Fatalf("final checkpoint: %d, %v", len(res.Identities), err)
	}
	first := map[identity.NumericIdentity]bool{}
	for _, p := range ps[:50] {
		first[before[p]] = true
	}
	var old []*identity.Identity
	for _, id := range res.Identities {
		if first[id.ID] {
			old = append(old, &id)
		}
	}
	if err := checkpoint.WriteFile(cpFile, checkpoint.AppendJSON(nil, old)); err != nil {
		t.Fatal(err)
	}

	b := newAgent(t, dir, 200*time.Millisecond, nil)
	b.start(t)
	if got := b.mapPairs(t); !equalMaps(got, before) {
		t.Fatalf("map differs after restart with a stale checkpoint")
	}
	st := b.r.Status()
	if st.Counters.Restored != 50 || st.Counters.PrefixesRestored != 100 || st.WithheldIDs != 50 {
		t.Fatalf("status: %+v", st)
	}
	b.waitReleased(t)
	if got := b.mapPairs(t); len(got) != 0 {
		t.Fatalf("%d map entries after the grace period", len(got))
	}
	if n := len(b.alloc.LocalIdentities()); n != 0 {
		t.Fatalf("%d local identities after the grace period", n)
	}
	if w := b.alloc.Withheld(); len(w) != 0 {
		t.Fatalf("withheld after the grace period: %v", w)
	}
	b.stop(t)
}

func updates(ps []netip.Prefix) []ipcache.Update {
	out := make([]ipcache.Update, len(ps))
	for i, p := range ps {
		out[i].Prefix = p
	}
	return out
}

func equalMaps[K comparable, V comparable](a, b map[K]V) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// startAllocator is a cell that allocates a new local identity in its start
// hook, as a cell that re-creates its state at start would.
type startAllocator struct {
	lbls string
	got  *identity.NumericIdentity
}

func (s startAllocator) cell(withRestorer bool) cell.Cell {
	if withRestorer {
		return cell.Invoke(func(lc cell.Lifecycle, a allocator.Allocator, _ *restoration.Restorer) { s.hook(lc, a) })
	}
	return cell.Invoke(func(lc cell.Lifecycle, a allocator.Allocator) { s.hook(lc, a) })
}

func (s startAllocator) hook(lc cell.Lifecycle, a allocator.Allocator) {
	lc.Append(cell.Hook{OnStart: func(ctx cell.HookContext) error {
		id, _, err := a.Allocate(ctx, mustLabels(s.lbls))
		if err == nil {
			*s.got = id.ID
		}
		return err
	}})
}

// TestStartOrder shows that the restoration's start hook runs before the
// start hooks of cells that allocate: both a cell that depends on the
// Restorer and one merely listed after restoration.Cell get numbers that
// do not collide with restored ones, and the restored ones keep theirs.
// It also shows that the map is unchanged when restoration reads it.
func TestStartOrder(t *testing.T) {
	dir := t.TempDir()
	// The checkpoint holds the first numbers a fresh allocator would hand
	// out.
	var ids []*identity.Identity
	var old []ipcachemap.Entry
	for i, p := range prefixes(10) {
		id := &identity.Identity{ID: identity.NumericIdentity(identity.ScopeLocal) + identity.NumericIdentity(i+1)}
		id.Labels = labelsOf(p)
		ids = append(ids, id)
		old = append(old, ipcachemap.Entry{Key: ipcachemap.Key{Prefix: p}, Value: ipcachemap.Value{Identity: id.ID}})
	}
	if err := checkpoint.WriteFile(filepath.Join(dir, checkpoint.FileName), checkpoint.AppendJSON(nil, ids)); err != nil {
		t.Fatal(err)
	}
	// An unknown ID in the map: withheld, and so not handed out either.
	unknown := identity.NumericIdentity(identity.ScopeLocal) + 11
	old = append(old, ipcachemap.Entry{Key: ipcachemap.Key{Prefix: netip.MustParsePrefix("192.0.2.0/24")}, Value: ipcachemap.Value{Identity: unknown}})
	writeMap(t, dir, old)

	var dependent, listedAfter identity.NumericIdentity
	var mapAtRestore []ipcache.MapEntry
	a := newAgent(t, dir, time.Hour, nil,
		startAllocator{lbls: "fqdn:after.example.com", got: &listedAfter}.cell(false),
		startAllocator{lbls: "fqdn:dep.example.com", got: &dependent}.cell(true),
		// A hook right before restoration's would see the map as the
		// restorer does: nothing may have written to it.
		cell.Invoke(func(lc cell.Lifecycle, ipc *ipcache.IPCache, r *restoration.Restorer) {
			lc.Append(cell.Hook{OnStart: func(cell.HookContext) error {
				var err error
				mapAtRestore, err = ipc.MapDump()
				return err
			}})
		}),
	)
	a.start(t)
	defer a.stop(t)

	restored := map[identity.NumericIdentity]bool{unknown: true}
	for _, id := range ids {
		restored[id.ID] = true
		if got := a.alloc.LookupByLabels(id.Labels); got == nil || got.ID != id.ID {
			t.Fatalf("%s: restored as %v, want %d", id.Labels, got, id.ID)
		}
	}
	for name, id := range map[string]identity.NumericIdentity{"dependent": dependent, "listed after": listedAfter} {
		if id == 0 || restored[id] {
			t.Fatalf("cell %s allocated %d, which collides with a restored identity", name, id)
		}
	}
	if len(mapAtRestore) != len(old) {
		t.Fatalf("map had %d entries after restoration's hook, want %d (pruned or changed before?)", len(mapAtRestore), len(old))
	}
	got := a.mapPairs(t)
	for _, e := range old {
		if got[e.Key.Prefix] != e.Value.Identity {
			t.Fatalf("%s: %d in the map, want %d", e.Key.Prefix, got[e.Key.Prefix], e.Value.Identity)
		}
	}
}

// orderProbe is a cell that uses the allocator as early and as late as it
// can, without depending on the Restorer: from jobs that start with its
// hooks it allocates a local identity, asks for the checkpoint's durability
// point, upserts a prefix with a direct identity (which allocates nothing)
// and samples the datapath map until told to stop; in its stop hook it
// allocates another local identity.
type orderProbe struct {
	// old are the map entries of the previous run that restoration
	// restores; restored are the checkpoint's identities.
	old      []ipcachemap.Entry
	restored []*identity.Identity
	// cpFile is the checkpoint of the previous run, cpInfo its file.
	cpFile string
	cpInfo os.FileInfo
	// stopSampling ends the sampling job.
	stopSampling chan struct{}

	mu sync.Mutex
	// early is the identity allocated from a job; notHeld are the
	// checkpoint's identities the allocator did not hold when that
	// allocation returned.
	early    *identity.Identity
	earlyErr error
	notHeld  []identity.NumericIdentity
	syncErr  error
	// late is the identity allocated in the stop hook.
	late    *identity.Identity
	lateErr error
	// samples counts the map dumps; violation is the first wrong one.
	samples   int
	violation string
}

var (
	earlyLabels  = mustLabels("fqdn:early.example.com")
	lateLabels   = mustLabels("fqdn:late.example.com")
	directPrefix = netip.MustParsePrefix("198.51.100.0/24")
)

func (p *orderProbe) cell() cell.Cell {
	return cell.Module("order-probe", "Allocates early and late",
		// Depending on the allocator only, the allocations do not order
		// the probe after the checkpoint, the ipcache or restoration.
		cell.Invoke(func(lc cell.Lifecycle, jobs job.Registry, h cell.Health, a allocator.Allocator) {
			jobs.NewGroup(h).Add(job.OneShot("allocate-early", func(ctx context.Context, _ cell.Health) error {
				p.allocateEarly(ctx, a)
				return nil
			}))
			lc.Append(cell.Hook{OnStop: func(ctx cell.HookContext) error {
				id, _, err := a.Allocate(ctx, lateLabels)
				p.mu.Lock()
				p.late, p.lateErr = id, err
				p.mu.Unlock()
				return nil
			}})
		}),
		cell.Invoke(func(jobs job.Registry, h cell.Health, a allocator.Allocator, ipc *ipcache.IPCache, syncer allocator.LocalIdentitySyncer) {
			jobs.NewGroup(h).Add(
				job.OneShot("sync-early", func(ctx context.Context, _ cell.Health) error {
					err := syncer.Sync(ctx)
					p.mu.Lock()
					p.syncErr = err
					p.mu.Unlock()
					return nil
				}),
				job.OneShot("sample-map", func(ctx context.Context, _ cell.Health) error {
					p.sampleMap(ctx, a, ipc)
					return nil
				}),
			)
		}),
	)
}

func (p *orderProbe) allocateEarly(ctx context.Context, a allocator.Allocator) {
	id, _, err := a.Allocate(ctx, earlyLabels)
	var notHeld []identity.NumericIdentity
	for _, r := range p.restored {
		if got := a.LookupByID(r.ID); got == nil || !got.Labels.Equal(r.Labels) {
			notHeld = append(notHeld, r.ID)
		}
	}
	p.mu.Lock()
	p.early, p.earlyErr, p.notHeld = id, err, notHeld
	p.mu.Unlock()
}

// sampleMap dumps the map until stopSampling is closed. Every dump must
// hold the old entries restoration restores (nothing pruned them), and a
// dump taken before restoration finished must hold nothing else (the
// reconciler wrote nothing yet, not even the probe's direct identity).
// Until restoration has finished, the checkpoint file must be the previous
// run's: nothing replaced it before restoration read it.
func (p *orderProbe) sampleMap(ctx context.Context, a allocator.Allocator, ipc *ipcache.IPCache) {
	if err := ipc.Upsert(ctx, "order-probe", directPrefix, ipcache.Info{Identity: identity.ReservedIdentityWorldIPv4}); err != nil {
		p.fail(fmt.Sprintf("direct upsert: %v", err))
	}
	ended, cancel := context.WithCancel(ctx)
	cancel()
	for {
		dump, err := ipc.MapDump()
		fi, statErr := os.Stat(p.cpFile)
		// Asked after the dump: if restoration has not finished now, it
		// had not when the dump was taken.
		restoring := a.WaitForRestoration(ended) != nil
		p.check(dump, err, restoring)
		if restoring && (statErr != nil || !os.SameFile(fi, p.cpInfo)) {
			p.fail(fmt.Sprintf("the checkpoint file was replaced before restoration finished (%v)", statErr))
		}
		select {
		case <-p.stopSampling:
			return
		case <-ctx.Done():
			return
		case <-time.After(time.Millisecond):
		}
	}
}

func (p *orderProbe) check(dump []ipcache.MapEntry, err error, restoring bool) {
	p.mu.Lock()
	p.samples++
	p.mu.Unlock()
	if err != nil {
		p.fail(fmt.Sprintf("map dump: %v", err))
		return
	}
	got := make(map[netip.Prefix]identity.NumericIdentity, len(dump))
	for _, e := range dump {
		got[e.Key.Prefix] = e.Value.Identity
	}
	for _, e := range p.old {
		if id, ok := got[e.Key.Prefix]; !ok || id != e.Value.Identity {
			p.fail(fmt.Sprintf("old entry %s → %d is %d (present: %t) in a map sample", e.Key.Prefix, e.Value.Identity, id, ok))
			return
		}
	}
	if restoring && len(dump) != len(p.old) {
		p.fail(fmt.Sprintf("the map holds %d entries before restoration finished, want the %d old ones: %v", len(dump), len(p.old), got))
	}
}

func (p *orderProbe) fail(msg string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.violation == "" {
		p.violation = msg
	}
}

var orderSeed = flag.Uint64("order-seed", 0, "seed of TestStartOrderByContract's shuffles (0: the time)")

// orderedCells are the cells of a restoring agent, as the agent lists them,
// and the probe. Each has a name for the log.
func orderedCells(p *orderProbe) (names []string, cells []cell.Cell) {
	named := []struct {
		name string
		c    cell.Cell
	}{
		{"health", cell.SimpleHealthCell},
		{"job", job.Cell},
		{"statedb", statedb.Cell},
		{"statedir", statedir.Cell},
		{"allocator", allocator.Cell},
		{"checkpoint", checkpoint.Cell},
		{"ipcache", ipcache.Cell},
		{"restoration", restoration.Cell},
		{"probe", p.cell()},
	}
	for _, n := range named {
		names = append(names, n.name)
		cells = append(cells, n.c)
	}
	return names, cells
}

// TestStartOrderByContract composes the cells in several orders (as the
// agent lists them, reversed and shuffled) over the state of a previous
// run, and checks in each that what keeps the state stable across restarts
// holds by contract, not by the order of the list:
//
//   - restoration runs before any other local allocation: the probe's
//     early identity takes no checkpoint number, and when it was allocated
//     the allocator held every checkpoint identity;
//   - the checkpoint's durability point, asked for at once, does not
//     replace the file before restoration read it: every checkpoint
//     identity is restored with its number;
//   - the datapath map keeps every old entry restoration restores in every
//     sample (nothing pruned them), and the reconciler writes nothing
//     before restoration has finished;
//   - the final checkpoint holds the identity the probe allocated in its
//     stop hook.
func TestStartOrderByContract(t *testing.T) {
	seed := *orderSeed
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Logf("shuffle seed %d (repeat with -order-seed)", seed)
	rng := rand.New(rand.NewPCG(seed, seed>>1|1))

	type order struct {
		name string
		perm []int
	}
	n := len(func() []string { names, _ := orderedCells(&orderProbe{}); return names }())
	listed := make([]int, n)
	for i := range listed {
		listed[i] = i
	}
	reversed := slices.Clone(listed)
	slices.Reverse(reversed)
	orders := []order{{"listed", listed}, {"reversed", reversed}}
	// The probe first: its jobs start before restoration's hook.
	probeFirst := append([]int{n - 1}, listed[:n-1]...)
	orders = append(orders, order{"probe-first", probeFirst})
	for i := range 5 {
		perm := slices.Clone(listed)
		rng.Shuffle(len(perm), func(a, b int) { perm[a], perm[b] = perm[b], perm[a] })
		orders = append(orders, order{fmt.Sprintf("shuffle-%d", i), perm})
	}

	for _, o := range orders {
		t.Run(o.name, func(t *testing.T) {
			runOrder(t, o.perm)
		})
	}
}

func runOrder(t *testing.T, perm []int) {
	dir := t.TempDir()
	// The previous run: its checkpoint holds the first numbers a fresh
	// allocator hands out, its map the prefixes of some of these
	// identities. The checkpoint is large enough that restoration takes a
	// while: what does not wait for it gets ahead of it.
	var restored []*identity.Identity
	var old []ipcachemap.Entry
	for i, pfx := range prefixes(3000) {
		id := &identity.Identity{ID: identity.NumericIdentity(identity.ScopeLocal) + identity.NumericIdentity(i+1), Labels: labelsOf(pfx)}
		restored = append(restored, id)
		if i%300 == 0 {
			old = append(old, ipcachemap.Entry{Key: ipcachemap.Key{Prefix: pfx}, Value: ipcachemap.Value{Identity: id.ID}})
		}
	}
	cpFile := filepath.Join(dir, checkpoint.FileName)
	if err := checkpoint.WriteFile(cpFile, checkpoint.AppendJSON(nil, restored)); err != nil {
		t.Fatal(err)
	}
	cpInfo, err := os.Stat(cpFile)
	if err != nil {
		t.Fatal(err)
	}
	writeMap(t, dir, old)

	p := &orderProbe{old: old, restored: restored, cpFile: cpFile, cpInfo: cpInfo, stopSampling: make(chan struct{})}
	names, all := orderedCells(p)
	var cells []cell.Cell
	var listed []string
	for _, i := range perm {
		cells = append(cells, all[i])
		listed = append(listed, names[i])
	}
	t.Logf("cells in order: %v", listed)
	var (
		r   *restoration.Restorer
		ipc *ipcache.IPCache
	)
	cells = append(cells, cell.Invoke(func(rr *restoration.Restorer, c *ipcache.IPCache) { r, ipc = rr, c }))
	h := hive.New(cells...)
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(h, func(c *ipcache.Config) { c.IPCacheMap = string(ipcachemap.KindFile) })
	hive.AddConfigOverride(h, func(c *checkpoint.Config) { c.IdentityCheckpointInterval = time.Hour })
	hive.AddConfigOverride(h, func(c *restoration.Config) { c.IdentityRestoreGracePeriod = time.Hour })

	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	running := testhive.Start(t, h)
	select {
	case <-r.Ready():
	case <-ctx.Done():
		t.Fatalf("restoration not ready: %+v", r.Status())
	}
	// The reconciler has written the probe's direct prefix: the samples
	// cover restoration and the writes after it.
	eventually.Within(t, time.Minute, "the reconciler writes the probe's direct prefix", func() bool {
		dump, err := ipc.MapDump()
		return err == nil && slices.ContainsFunc(dump, func(e ipcache.MapEntry) bool { return e.Key.Prefix == directPrefix })
	})
	eventually.Within(t, time.Minute, "map samples after restoration", func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.early != nil || p.earlyErr != nil
	})
	close(p.stopSampling)

	if c := r.Counters(); c.Restored != uint64(len(restored)) || c.Renumbered != 0 || c.Skipped != 0 {
		t.Errorf("restoration counters %+v, want %d restored and none renumbered or skipped", c, len(restored))
	}
	p.mu.Lock()
	early, earlyErr, notHeld, syncErr := p.early, p.earlyErr, p.notHeld, p.syncErr
	samples, violation := p.samples, p.violation
	p.mu.Unlock()
	if earlyErr != nil {
		t.Fatalf("early allocation: %v", earlyErr)
	}
	if slices.ContainsFunc(restored, func(id *identity.Identity) bool { return id.ID == early.ID }) {
		t.Errorf("the probe's early identity %d took a checkpoint number", early.ID)
	}
	if len(notHeld) > 0 {
		t.Errorf("%d checkpoint identities (first %d) not restored yet when the probe's early identity %d was allocated", len(notHeld), notHeld[0], early.ID)
	}
	if syncErr != nil {
		t.Errorf("early checkpoint sync: %v", syncErr)
	}
	if violation != "" {
		t.Errorf("after %d map samples: %s", samples, violation)
	}

	running.Stop()
	p.mu.Lock()
	late, lateErr := p.late, p.lateErr
	p.mu.Unlock()
	if lateErr != nil {
		t.Fatalf("allocation in the probe's stop hook: %v", lateErr)
	}
	res, err := checkpoint.Loader{}.Load(cpFile)
	if err != nil {
		t.Fatal(err)
	}
	inFile := map[identity.NumericIdentity]string{}
	for _, id := range res.Identities {
		inFile[id.ID] = id.Labels.String()
	}
	for _, want := range append([]*identity.Identity{early, late}, restored...) {
		if inFile[want.ID] != want.Labels.String() {
			t.Errorf("final checkpoint lacks %d %s (has %q)", want.ID, want.Labels, inFile[want.ID])
			break
		}
	}
}

// pendingRestoration is an allocator.Restoration that finishes when its
// channel is closed.
type pendingRestoration chan struct{}

func (r pendingRestoration) Done() <-chan struct{} { return r }

// TestAllocationsWaitForRestoration checks the allocator's side of the
// contract with a restoration that has not finished: a local allocation
// waits for it and fails at --identity-allocation-timeout, a batch waits
// once for all its local requests, restoration's own allocations (restored,
// or under allocator.Restoring) and reserved ones do not wait, and once it
// has finished every allocation goes through.
func TestAllocationsWaitForRestoration(t *testing.T) {
	const timeout = 300 * time.Millisecond
	pending := make(pendingRestoration)
	var alloc allocator.Allocator
	h := hive.New(
		cell.SimpleHealthCell, job.Cell, statedb.Cell, allocator.Cell,
		cell.Provide(func() allocator.RestorationOut { return allocator.NewRestoration(pending) }),
		cell.Invoke(func(a allocator.Allocator) { alloc = a }),
	)
	hive.AddConfigOverride(h, func(c *allocator.Config) { c.IdentityAllocationTimeout = timeout })
	testhive.Start(t, h)
	ctx := t.Context()

	begin := time.Now()
	if _, _, err := alloc.Allocate(ctx, mustLabels("fqdn:early.example.com")); err == nil || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("local allocation before restoration finished: %v, want a timeout", err)
	}
	if d := time.Since(begin); d < timeout {
		t.Fatalf("local allocation gave up after %s, before the allocation timeout %s", d, timeout)
	}
	begin = time.Now()
	results := alloc.AllocateBatch(ctx, []allocator.Request{
		{Labels: mustLabels("fqdn:a.example.com")},
		{Labels: mustLabels("fqdn:b.example.com")},
		{Labels: mustLabels("fqdn:c.example.com")},
		{Labels: mustLabels("fqdn:d.example.com")},
		{Labels: mustLabels("fqdn:e.example.com")},
		{Labels: mustLabels("fqdn:restored.example.com"), Restored: true},
		{Labels: mustLabels("reserved:host")},
	})
	if d := time.Since(begin); d > 3*timeout {
		t.Fatalf("a batch of five waiting requests took %s: it waited for each", d)
	}
	for i, r := range results {
		if waits := i < 5; waits != (r.Err != nil) {
			t.Fatalf("batch request %d: %+v (waits for restoration: %t)", i, r, waits)
		}
	}
	if _, _, err := alloc.Allocate(allocator.Restoring(ctx), mustLabels("cidr:10.0.0.0/8")); err != nil {
		t.Fatalf("allocation under allocator.Restoring: %v", err)
	}
	if _, _, err := alloc.Allocate(ctx, mustLabels("fqdn:own.example.com"), allocator.AsRestored()); err != nil {
		t.Fatalf("restored allocation: %v", err)
	}
	short, cancel := context.WithTimeout(ctx, 10*time.Millisecond)
	defer cancel()
	if err := alloc.WaitForRestoration(short); err == nil {
		t.Fatal("WaitForRestoration returned before restoration finished")
	}

	close(pending)
	ended, cancelEnded := context.WithCancel(ctx)
	cancelEnded()
	if err := alloc.WaitForRestoration(ended); err != nil {
		t.Fatalf("WaitForRestoration after restoration finished, with an ended context: %v", err)
	}
	if _, _, err := alloc.Allocate(ctx, mustLabels("fqdn:early.example.com")); err != nil {
		t.Fatalf("local allocation after restoration finished: %v", err)
	}
}

// TestPartialFailure: a corrupt checkpoint, entries restoration must skip
// and map entries that are not its business; the agent starts, restores
// the rest, and withholds the numbers the corrupt checkpoint may have
// given.
func TestPartialFailure(t *testing.T) {
	dir := t.TempDir()
	cpFile := filepath.Join(dir, checkpoint.FileName)
	if err := os.WriteFile(cpFile, []byte(`[{"id":16777217,"labels":`), 0o600); err != nil {
		t.Fatal(err)
	}
	local := func(n uint32) identity.NumericIdentity {
		return identity.NumericIdentity(identity.ScopeLocal) + identity.NumericIdentity(n)
	}
	entry := func(p string, id identity.NumericIdentity) ipcachemap.Entry {
		return ipcachemap.Entry{Key: ipcachemap.Key{Prefix: netip.MustParsePrefix(p)}, Value: ipcachemap.Value{Identity: id}}
	}
	tunnelled := entry("10.9.0.1/32", local(9))
	tunnelled.Value.TunnelEndpoint = netip.MustParseAddr("192.0.2.1")
	remoteCluster := entry("10.9.0.2/32", local(10))
	remoteCluster.Key.ClusterID = 3
	writeMap(t, dir, []ipcachemap.Entry{
		entry("10.0.0.1/32", local(5)),
		entry("10.0.0.2/32", local(7)),
		// Two prefixes with one unknown ID keep it both.
		entry("10.1.0.0/16", local(20)),
		entry("10.2.0.0/16", local(20)),
		entry("10.3.0.0/16", identity.ReservedIdentityIngress),
		// Not restoration's business:
		entry("10.4.0.0/16", 300), // global
		tunnelled,
		remoteCluster,
	})

	a := newAgent(t, dir, time.Hour, nil)
	a.start(t)
	defer a.stop(t)
	st := a.r.Status()
	if st.CheckpointError == "" || st.Counters.PrefixesRestored != 5 || st.Counters.PrefixesFailed != 0 {
		t.Fatalf("status: %+v", st)
	}
	want := map[netip.Prefix]identity.NumericIdentity{
		netip.MustParsePrefix("10.0.0.1/32"): local(5),
		netip.MustParsePrefix("10.0.0.2/32"): local(7),
		netip.MustParsePrefix("10.1.0.0/16"): local(20),
		netip.MustParsePrefix("10.2.0.0/16"): local(20),
		netip.MustParsePrefix("10.3.0.0/16"): identity.ReservedIdentityIngress,
	}
	// Pruning of the others runs once the table is initialized.
	if got := a.waitMap(t, want); !equalMaps(got, want) {
		t.Fatalf("map after restoration:\n got %v\nwant %v", got, want)
	}
	// The map's unknown numbers are withheld, and, as the corrupt
	// checkpoint hides which numbers were answered, every number of the
	// local scopes up to a margin above the highest seen.
	w := a.alloc.Withheld()
	for _, id := range []identity.NumericIdentity{local(5), local(7), local(20), local(21), local(1)} {
		if !slices.Contains(w, id) {
			t.Fatalf("%d not among the %d numbers withheld", id, len(w))
		}
	}
	if u := a.r.Status().Counters.UnknownWithheld; u == 0 || int(u) > len(w) {
		t.Fatalf("%d numbers withheld as unknown, %d in all", u, len(w))
	}
	matches, _ := filepath.Glob(cpFile + ".corrupt-*")
	if len(matches) != 1 {
		t.Fatalf("corrupt checkpoint not set aside: %v", matches)
	}
}

// TestSkipScopeChanged: checkpoint entries whose label set now has
// another scope, or needs a global identity, are skipped and counted.
func TestSkipScopeChanged(t *testing.T) {
	dir := t.TempDir()
	// Written by hand: the checkpoint's own encoder refuses nothing, but
	// another version's scope rules may differ.
	data := `[{"id":16777217,"labels":{"app":{"key":"app","value":"web","source":"k8s"}}},` +
		`{"id":33554434,"labels":{"10.0.0.0/8":{"key":"10.0.0.0/8","source":"cidr"},"world":{"key":"world","source":"reserved"}}},` +
		`{"id":16777218,"labels":{"10.0.0.0/8":{"key":"10.0.0.0/8","source":"cidr"},"world":{"key":"world","source":"reserved"}}}]`
	if err := os.WriteFile(filepath.Join(dir, checkpoint.FileName), []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	a := newAgent(t, dir, time.Hour, nil)
	a.start(t)
	defer a.stop(t)
	c := a.r.Counters()
	if c.Restored != 1 || c.Skipped != 2 {
		t.Fatalf("counters: %+v", c)
	}
	if id := a.alloc.LookupByLabels(mustLabels("cidr:10.0.0.0/8", "reserved:world")); id == nil || id.ID != 16777218 {
		t.Fatalf("restored identity: %v", id)
	}
}

// TestCiliumCheckpoint restores a checkpoint as Cilium v1.16 writes it,
// with elements and keys in another order than identityd writes them.
func TestCiliumCheckpoint(t *testing.T) {
	dir := t.TempDir()
	data := `[{"labels":{"remote-node":{"source":"reserved","key":"remote-node"},"192.168.1.10/32":{"source":"cidr","key":"192.168.1.10/32"}},"id":33554433},` +
		`{"labels":{"world":{"source":"reserved","key":"world"},"10.0.0.0/8":{"source":"cidr","key":"10.0.0.0/8"}},"id":16777217}]` + "\n"
	if err := os.WriteFile(filepath.Join(dir, checkpoint.FileName), []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	a := newAgent(t, dir, time.Hour, nil)
	a.start(t)
	defer a.stop(t)
	for lbls, want := range map[string]identity.NumericIdentity{
		"cidr:10.0.0.0/8 reserved:world":            16777217,
		"cidr:192.168.1.10/32 reserved:remote-node": 33554433,
	} {
		id := a.alloc.LookupByLabels(mustLabels(strings.Fields(lbls)...))
		if id == nil || id.ID != want {
			t.Fatalf("%s: restored as %v, want %d", lbls, id, want)
		}
	}
	if c := a.r.Counters(); c.Restored != 2 || c.Skipped != 0 {
		t.Fatalf("counters: %+v", c)
	}
}

// TestCheckpointFromNodesMode reads a checkpoint written under
// --policy-cidr-match-mode=nodes without that mode, as Cilium does: the
// remote-node-scope entry's label set is the reserved remote-node identity
// now, and its old number is not re-created.
func TestCheckpointFromNodesMode(t *testing.T) {
	dir := t.TempDir()
	data := `[{"labels":{"remote-node":{"source":"reserved","key":"remote-node"},"192.168.1.10/32":{"source":"cidr","key":"192.168.1.10/32"}},"id":33554433},` +
		`{"labels":{"world":{"source":"reserved","key":"world"},"10.0.0.0/8":{"source":"cidr","key":"10.0.0.0/8"}},"id":16777217}]` + "\n"
	if err := os.WriteFile(filepath.Join(dir, checkpoint.FileName), []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	a := newAgentWith(t, dir, time.Hour, nil, func(c *allocator.Config) { c.PolicyCIDRMatchMode = nil })
	a.start(t)
	defer a.stop(t)
	if id := a.alloc.LookupByLabels(mustLabels("cidr:192.168.1.10/32", "reserved:remote-node")); id == nil || id.ID != identity.ReservedIdentityRemoteNode {
		t.Fatalf("remote node's set resolves to %v, want 6", id)
	}
	if id := a.alloc.LookupByID(33554433); id != nil {
		t.Fatalf("old remote-node-scope number still stands for %v", id)
	}
	if id := a.alloc.LookupByID(16777217); id == nil {
		t.Fatal("the node-local entry was not restored")
	}
	if c := a.r.Counters(); c.Restored != 1 || c.Renumbered != 1 {
		t.Fatalf("counters: %+v, want 1 restored and 1 renumbered", c)
	}
}

// TestScript runs testdata/*.txtar against the cells restoration works
// with, on a state directory and a file map that outlive each hive: the
// script restarts the agent with hive/restart, and the new hive restores
// what the stopped one left. The #! line sets flags of every hive.
func TestScript(t *testing.T) {
	// Bounded, so that a retried line that cannot match fails the test
	// instead of retrying until the test binary's timeout.
	// The scripts run as parallel subtests, after this function returns.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	scripttest.Test(t, ctx,
		func(t testing.TB, args []string) *script.Engine {
			dir := t.TempDir()
			build := func() (*hive.Hive, error) {
				h := hive.New(
					cell.SimpleHealthCell, job.Cell, statedb.Cell, statedir.Cell,
					allocator.Cell, checkpoint.Cell, ipcache.Cell, restoration.Cell,
					cell.Provide(func(sh *cell.SimpleHealth) hive.ScriptCmdsOut {
						return hive.NewScriptCmds(map[string]script.Cmd{"health": cell.SimpleHealthCmd(sh)})
					}),
				)
				hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
				hive.AddConfigOverride(h, func(c *ipcache.Config) { c.IPCacheMap = string(ipcache.MapKindFile) })
				// Only the final checkpoint of a clean stop, so that what a
				// restart finds does not depend on timing.
				hive.AddConfigOverride(h, func(c *checkpoint.Config) { c.IdentityCheckpointInterval = time.Hour })
				scriptengine.ParseFlags(t, h, args)
				return h, nil
			}
			return scriptengine.NewRestartable(t, build)
		}, nil, "testdata/*.txtar")
}
