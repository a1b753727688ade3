package ipcache_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/script"

	"github.com/identityd/identityd/cells/checkpoint"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/allocatortest"
	"github.com/identityd/identityd/internal/eventually"
	"github.com/identityd/identityd/internal/ipcachemap"
	"github.com/identityd/identityd/labels"
)

// crashState returns what a crash of the agent would leave on disk right
// now: the datapath map file's entries and the checkpoint's identities,
// each with its journal replayed, read from copies so that the agent's
// files stay untouched. Both files are written by renames and the journals
// are read up to their last whole record, so a copy is always one state.
func crashState(t *testing.T, dir string) (map[netip.Prefix]identity.NumericIdentity, map[identity.NumericIdentity]string) {
	t.Helper()
	cp := t.TempDir()
	for _, name := range []string{ipcachemap.FileName, ipcachemap.FileName + ipcachemap.JournalSuffix, checkpoint.FileName, checkpoint.JournalFileName} {
		data, err := os.ReadFile(filepath.Join(dir, name))
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			t.Error(err)
			return nil, nil
		}
		if err := os.WriteFile(filepath.Join(cp, name), data, 0o600); err != nil {
			t.Error(err)
			return nil, nil
		}
	}
	m, _, err := ipcachemap.Open(ipcachemap.Config{Kind: ipcachemap.KindFile, FilePath: filepath.Join(cp, ipcachemap.FileName), Journal: true})
	if err != nil {
		t.Error(err)
		return nil, nil
	}
	defer m.Close()
	pairs := map[netip.Prefix]identity.NumericIdentity{}
	m.Dump(func(k ipcachemap.Key, v ipcachemap.Value) bool {
		pairs[k.Prefix] = v.Identity
		return true
	})
	res, err := checkpoint.Loader{}.LoadJournaled(filepath.Join(cp, checkpoint.FileName))
	if err != nil {
		t.Error(err)
		return nil, nil
	}
	ids := map[identity.NumericIdentity]string{}
	for _, id := range res.Identities {
		ids[id.ID] = id.Labels.String()
	}
	return pairs, ids
}

// TestWaitDurable upserts prefixes from concurrent callers, each waiting
// for the durability point, with a checkpoint interval of an hour: as soon
// as WaitDurable returns, a crash would leave the caller's pair in the map
// file and its identity in the checkpoint. Upsert alone answers before
// either is on disk.
func TestWaitDurable(t *testing.T) {
	n := newNode(t, nil, checkpoint.Cell)
	hiveOverrideCheckpointInterval(n, time.Hour)
	n.start(t)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()

	// Without waiting, nothing is on disk yet: the map file is written
	// at most every 200ms and the checkpoint in an hour.
	first := pfx("10.0.0.0/24")
	if err := n.ipc.Upsert(ctx, "test", first, ipcache.Info{}); err != nil {
		t.Fatal(err)
	}
	id := mustGet(t, n.ipc, first.String()).Identity
	pairs, ids := crashState(t, n.dir)
	if pairs[first] == id && ids[id] != "" {
		// A loaded machine can let both writes happen before this
		// read; the concurrent callers below still tell.
		t.Logf("the pair %s -> %d was durable before the wait: the first check tells nothing in this run", first, id)
	}
	if err := n.ipc.WaitDurable(ctx, first); err != nil {
		t.Fatal(err)
	}
	pairs, ids = crashState(t, n.dir)
	if pairs[first] != id || ids[id] == "" {
		t.Fatalf("after WaitDurable a crash leaves map %d and checkpoint %q for %s -> %d", pairs[first], ids[id], first, id)
	}

	// Concurrent callers share the writes.
	const callers, each = 16, 8
	var wg sync.WaitGroup
	for c := range callers {
		wg.Go(func() {
			for i := range each {
				p := netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 1, byte(c), byte(i)}), 32)
				if err := n.ipc.Upsert(ctx, "test", p, ipcache.Info{}); err != nil {
					t.Error(err)
					return
				}
				if err := n.ipc.WaitDurable(ctx, p); err != nil {
					t.Error(err)
					return
				}
				e, ok := n.ipc.LookupPrefix(p)
				if !ok {
					t.Errorf("no row for %s", p)
					return
				}
				pairs, ids := crashState(t, n.dir)
				if pairs[p] != e.Identity || ids[e.Identity] != e.Labels.String() {
					t.Errorf("after WaitDurable a crash leaves map %d and checkpoint %q for %s -> %d %s",
						pairs[p], ids[e.Identity], p, e.Identity, e.Labels)
				}
			}
		})
	}
	wg.Wait()
}

// TestWaitDurableMapFull checks that a prefix the map refuses makes
// WaitDurable fail at once instead of waiting for a retry that cannot
// succeed, and that the other prefixes of the batch are durable.
func TestWaitDurableMapFull(t *testing.T) {
	n := newNode(t, func(c *ipcache.Config) { c.IPCacheMapMaxEntries = 2 }, checkpoint.Cell)
	n.start(t)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	ps := []netip.Prefix{pfx("10.0.0.0/8"), pfx("10.1.0.0/16"), pfx("10.2.0.0/16")}
	var updates []ipcache.Update
	for _, p := range ps {
		updates = append(updates, ipcache.Update{Prefix: p})
	}
	if err := n.ipc.UpsertBatch(ctx, "test", updates); err != nil {
		t.Fatal(err)
	}
	err := n.ipc.WaitDurable(ctx, ps...)
	if !errors.Is(err, ipcache.ErrNotWritten) {
		t.Fatalf("WaitDurable: %v, want ErrNotWritten", err)
	}
	if ctx.Err() != nil {
		t.Fatal("WaitDurable waited for the context")
	}
	pairs, _ := crashState(t, n.dir)
	if len(pairs) != 2 {
		t.Fatalf("map file holds %v, want the two prefixes that fit", pairs)
	}

	// A context that ends first ends the wait.
	cctx, ccancel := context.WithCancel(ctx)
	ccancel()
	if err := n.ipc.WaitDurable(cctx, pfx("10.2.0.0/16")); err == nil {
		t.Fatal("WaitDurable with an ended context returned nil")
	}
}

// TestWaitDurableRemove checks that a removal is durable once WaitDurable
// returns: the map file no longer has the prefix.
func TestWaitDurableRemove(t *testing.T) {
	n := startNode(t)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	p := pfx("192.0.2.0/24")
	if err := n.ipc.Upsert(ctx, "test", p, ipcache.Info{}); err != nil {
		t.Fatal(err)
	}
	if err := n.ipc.WaitDurable(ctx, p); err != nil {
		t.Fatal(err)
	}
	if err := n.ipc.Remove(ctx, "test", p); err != nil {
		t.Fatal(err)
	}
	if err := n.ipc.WaitDurable(ctx, p); err != nil {
		t.Fatal(err)
	}
	if pairs, _ := crashState(t, n.dir); len(pairs) != 0 {
		t.Fatalf("map file holds %v after the removal", pairs)
	}
}

func hiveOverrideCheckpointInterval(n *node, d time.Duration) {
	hive.AddConfigOverride(n.hive, func(c *checkpoint.Config) { c.IdentityCheckpointInterval = d })
}

// TestStopWritesPendingRows stops the hive right after upserts and removals
// that nobody waited for: the stop writes them to the map before closing
// it, so that a clean stop keeps every pair and no removed prefix. The reconciler runs a round at most every
// 20ms, so without that the second batch is still pending at the stop.
func TestStopWritesPendingRows(t *testing.T) {
	n := newNode(t, nil)
	log := hivetest.Logger(t)
	if err := n.hive.Start(log, t.Context()); err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	want := map[netip.Prefix]identity.NumericIdentity{}
	for batch := range 2 {
		var updates []ipcache.Update
		for i := range 500 {
			updates = append(updates, ipcache.Update{Prefix: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(batch), byte(i >> 8), byte(i)}), 32)})
		}
		if err := n.ipc.UpsertBatch(ctx, "test", updates); err != nil {
			t.Fatal(err)
		}
		for _, u := range updates {
			want[u.Prefix] = mustGet(t, n.ipc, u.Prefix.String()).Identity
		}
	}
	// Removals nobody waited for reach the map too.
	var removed []netip.Prefix
	for p := range want {
		if p.Addr().As4()[3]%10 == 0 {
			removed = append(removed, p)
		}
	}
	if err := n.ipc.Remove(ctx, "test", removed...); err != nil {
		t.Fatal(err)
	}
	for _, p := range removed {
		delete(want, p)
	}
	if err := n.hive.Stop(log, context.Background()); err != nil {
		t.Fatal(err)
	}
	pairs, _ := crashState(t, n.dir)
	lost := 0
	for p, id := range want {
		if pairs[p] != id {
			lost++
		}
	}
	if lost > 0 {
		t.Fatalf("%d of %d pairs not in the map file after a clean stop", lost, len(want))
	}
	for _, p := range removed {
		if id, ok := pairs[p]; ok {
			t.Fatalf("removed prefix %s still in the map file (identity %d) after a clean stop", p, id)
		}
	}
}

// stallTimeout is the --identity-allocation-timeout of the tests of a
// stalled disk or store.
const stallTimeout = time.Second

// runBounded runs a shell command on the node and returns its error. It
// fails the test when no answer comes within stallTimeout plus what a
// loaded machine adds, after calling unstall so that the command can end.
func runBounded(t *testing.T, n *node, line string, unstall func()) error {
	t.Helper()
	cmds, err := n.hive.ScriptCommands(hivetest.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	e := &script.Engine{Cmds: cmds}
	s, err := script.NewState(t.Context(), n.dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	done := make(chan error, 1)
	go func() { done <- e.ExecuteLine(s, line, io.Discard) }()
	select {
	case err := <-done:
		t.Logf("%s answered after %s: %v", line, time.Since(start), err)
		return err
	case <-time.After(stallTimeout + 5*time.Second):
		unstall()
		<-done
		t.Fatalf("%s gave no answer within %s (--identity-allocation-timeout %s)", line, time.Since(start), stallTimeout)
		return nil
	}
}

// TestUpsertMapFileStalled checks that ipcache/upsert answers within
// --identity-allocation-timeout when the fsync of the datapath map's file
// hangs: it fails with an error that names the bound and the map file, the
// table keeps the row (the upsert stays applied), and once the disk answers
// the pair reaches the file.
func TestUpsertMapFileStalled(t *testing.T) {
	var armed atomic.Bool
	stalled, resume := make(chan struct{}), make(chan struct{})
	var stallOnce, resumeOnce sync.Once
	fault := func(step string) error {
		if step == "fsync" && armed.Load() {
			stallOnce.Do(func() { close(stalled) })
			<-resume
		}
		return nil
	}
	// The disk answers before the hive stops, whatever the test's outcome.
	answer := func() { resumeOnce.Do(func() { armed.Store(false); close(resume) }) }
	n := newNode(t, nil, cell.Invoke(func(c *ipcache.IPCache) { ipcache.SetMapWriteFault(c, fault) }))
	n.allocTimeout = stallTimeout
	n.start(t)
	defer answer()
	armed.Store(true)

	p := pfx("10.7.0.0/16")
	err := runBounded(t, n, "ipcache/upsert "+p.String(), answer)
	if err == nil {
		t.Fatal("ipcache/upsert succeeded while the map file's fsync hung")
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("error %v, want one that wraps context.DeadlineExceeded", err)
	}
	for _, want := range []string{
		"applied to the ipcache table, but not durable within --identity-allocation-timeout (1s)",
		"write the ipcache map file",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	select {
	case <-stalled:
	default:
		t.Fatal("the command failed before a write of the map file reached fsync")
	}
	row := mustGet(t, n.ipc, p.String())

	// The disk answers: the pair reaches the file.
	answer()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	if err := n.ipc.WaitDurable(ctx, p); err != nil {
		t.Fatal(err)
	}
	if pairs, _ := crashState(t, n.dir); pairs[p] != row.Identity {
		t.Fatalf("map file has %d for %s after the disk answered, want %d", pairs[p], p, row.Identity)
	}
}

// TestUpsertStoreStalled checks that ipcache/upsert of a prefix with a
// global identity answers within --identity-allocation-timeout when the
// store of global identities accepts requests and never answers: it fails
// with an error that names the bound and the prefix, and the prefix is left
// as it was.
func TestUpsertStoreStalled(t *testing.T) {
	store := allocatortest.NewStore(identity.ClusterInfo{Name: identity.DefaultClusterName})
	n := newNode(t, nil, allocatortest.DriverCell(identity.AllocationModeKVStore, store.NewBackend("node1")))
	n.allocTimeout = stallTimeout
	n.start(t)
	store.Stalled.Store(true)

	p := pfx("10.9.0.0/16")
	err := runBounded(t, n, "ipcache/upsert --labels=k8s:app=web "+p.String(), func() { store.Stalled.Store(false) })
	if err == nil {
		t.Fatal("ipcache/upsert succeeded while the store did not answer")
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("error %v, want one that wraps context.DeadlineExceeded", err)
	}
	if want := "not all applied within --identity-allocation-timeout (1s) (the prefixes named here are left as they were): " + p.String(); !strings.Contains(err.Error(), want) {
		t.Errorf("error %q does not say %q", err, want)
	}
	if e, ok := n.ipc.LookupPrefix(p); ok {
		t.Fatalf("row %v after the failed command, want none", e)
	}
}

// TestReleaseDoesNotBlockWriters: a delete whose release waits for a store
// of global identities that does not answer holds up no other writer of
// the ipcache. Releases used to run with the writers' lock held, so with
// etcd gone every upsert waited behind every pending release, one
// --identity-allocation-timeout each.
func TestReleaseDoesNotBlockWriters(t *testing.T) {
	store := allocatortest.NewStore(identity.ClusterInfo{Name: identity.DefaultClusterName})
	backend := store.NewBackend("node1")
	n := newNode(t, nil, allocatortest.DriverCell(identity.AllocationModeKVStore, backend))
	const releaseBound = 5 * time.Second
	n.allocTimeout = releaseBound
	n.start(t)
	ctx := t.Context()
	web := pfx("10.9.0.0/16")
	if err := n.ipc.Upsert(ctx, "pods", web, ipcache.Info{Labels: labels.MustParse("k8s:app=web")}); err != nil {
		t.Fatal(err)
	}

	store.Stalled.Store(true)
	defer store.Stalled.Store(false)
	before := backend.Requests.Load()
	removed := make(chan error, 1)
	go func() { removed <- n.ipc.Remove(ctx, "pods", web) }()
	eventually.True(t, "the delete waits for the store to release the identity", func() bool {
		_, ok := n.ipc.LookupPrefix(web)
		return !ok && backend.Requests.Load() > before
	})
	start := time.Now()
	if err := n.ipc.Upsert(ctx, "k8s", pfx("10.10.0.0/16"), ipcache.Info{}); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took > releaseBound/2 {
		t.Errorf("an upsert that needs no store took %s while a delete's release waited for the store", took)
	}
	if err := <-removed; err != nil {
		t.Errorf("delete whose release the store did not answer: %v (the release is logged, the delete applied)", err)
	}
}

// TestDurableUpsertAppends: with a checkpoint interval of an hour, waited
// upserts of new prefixes append to the journals and rewrite neither the
// map file nor the checkpoint, and repeating an upsert already durable
// (same owner, same identity) waits for no write at all.
func TestDurableUpsertAppends(t *testing.T) {
	var fsyncs atomic.Int64
	fault := func(step string) error {
		if step == "fsync" {
			fsyncs.Add(1)
		}
		return nil
	}
	n := newNode(t, nil, checkpoint.Cell, cell.Invoke(func(c *ipcache.IPCache) { ipcache.SetMapWriteFault(c, fault) }))
	hiveOverrideCheckpointInterval(n, time.Hour)
	n.start(t)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	const count = 20
	for i := range count {
		p := pfx(fmt.Sprintf("10.20.%d.0/24", i))
		if err := n.ipc.Upsert(ctx, "test", p, ipcache.Info{}); err != nil {
			t.Fatal(err)
		}
		if err := n.ipc.WaitDurable(ctx, p); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range []string{ipcachemap.FileName, checkpoint.FileName} {
		if _, err := os.Stat(filepath.Join(n.dir, name)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s written by durable answers (%v): the journals should hold them", name, err)
		}
	}
	pairs, ids := crashState(t, n.dir)
	if len(pairs) != count || len(ids) != count {
		t.Fatalf("a crash leaves %d pairs and %d identities, want %d", len(pairs), len(ids), count)
	}
	// The map's journal fsyncs once per waited answer at most.
	if f := fsyncs.Load(); f > count {
		t.Fatalf("%d map journal fsyncs for %d answers", f, count)
	}
	before := fsyncs.Load()
	jsize := func() int64 {
		fi, err := os.Stat(filepath.Join(n.dir, checkpoint.JournalFileName))
		if err != nil {
			t.Fatal(err)
		}
		return fi.Size()
	}
	jbefore := jsize()
	p := pfx("10.20.3.0/24")
	if err := n.ipc.Upsert(ctx, "test", p, ipcache.Info{}); err != nil {
		t.Fatal(err)
	}
	if err := n.ipc.WaitDurable(ctx, p); err != nil {
		t.Fatal(err)
	}
	if f := fsyncs.Load(); f != before {
		t.Fatalf("repeating a durable upsert cost %d map journal fsyncs", f-before)
	}
	if jsize() != jbefore {
		t.Fatal("repeating a durable upsert wrote to the identity journal")
	}
}
