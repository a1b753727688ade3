package restoration_test

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
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
	"github.com/identityd/identityd/internal/ipcachemap"
	"github.com/identityd/identityd/internal/scriptengine"
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

// TestPartialFailure: a corrupt checkpoint, entries restoration must skip
// and map entries that are not its business; the agent starts and restores
// the rest.
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
	if w := a.alloc.Withheld(); !slices.Equal(w, []identity.NumericIdentity{local(5), local(7), local(20)}) {
		t.Fatalf("withheld: %v", w)
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
