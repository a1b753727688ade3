package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/hive/script"
	"github.com/cilium/statedb"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/eventually"
	"github.com/identityd/identityd/internal/journal"
	"github.com/identityd/identityd/internal/testhive"
	"github.com/identityd/identityd/labels"
)

// syncHive starts the checkpoint with its allocator, with a checkpoint
// interval of an hour: only Sync writes while the test runs. The hive
// stops when the test ends.
func syncHive(t testing.TB, dir string, overrides ...func(*hive.Hive)) (*hive.Hive, *Checkpoint, allocator.Allocator) {
	t.Helper()
	return syncHiveEvery(t, dir, time.Hour, overrides...)
}

// syncHiveEvery is syncHive with the given --identity-checkpoint-interval.
func syncHiveEvery(t testing.TB, dir string, interval time.Duration, overrides ...func(*hive.Hive)) (*hive.Hive, *Checkpoint, allocator.Allocator) {
	t.Helper()
	var (
		cp    *Checkpoint
		alloc allocator.Allocator
	)
	h := hive.New(
		cell.SimpleHealthCell, job.Cell, statedb.Cell, allocator.Cell, statedir.Cell, Cell,
		cell.Invoke(func(c *Checkpoint, a allocator.Allocator) { cp, alloc = c, a }),
	)
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(h, func(c *Config) { c.IdentityCheckpointInterval = interval })
	for _, o := range overrides {
		o(h)
	}
	testhive.Start(t, h)
	return h, cp, alloc
}

// fileIDs returns the identities a restart would find at path: the
// checkpoint file's, with the journal beside it replayed over them.
func fileIDs(t *testing.T, path string) map[identity.NumericIdentity]bool {
	t.Helper()
	res, err := Loader{}.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	ids := res.Identities
	if data, err := os.ReadFile(filepath.Join(filepath.Dir(path), JournalFileName)); err == nil {
		ids, _, _ = replay(ids, journal.Decode(data, journalKind).Records)
	}
	out := map[identity.NumericIdentity]bool{}
	for _, id := range ids {
		out[id.ID] = true
	}
	return out
}

// TestSyncWritesAtOnce checks that Sync puts a new local identity on disk
// at once, whatever the checkpoint interval, and that a Sync with nothing
// new since a write that began after the call does not write again.
func TestSyncWritesAtOnce(t *testing.T) {
	dir := t.TempDir()
	_, cp, alloc := syncHive(t, dir)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()

	id, _, err := alloc.Allocate(ctx, cidr("10.1.0.0/16"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(cp.Path()); err == nil {
		t.Fatal("checkpoint written before the interval without Sync: the test cannot tell")
	}
	if err := cp.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	if !fileIDs(t, cp.Path())[id.ID] {
		t.Fatalf("checkpoint after Sync lacks identity %d", id.ID)
	}
	if w := cp.Status().Counters.Writes; w != 1 {
		t.Fatalf("%d writes after one Sync, want 1", w)
	}
}

// TestSyncCoalesces runs many Syncs while a write is running: they all wait
// for it and then share a single write, which holds every identity
// allocated before them.
func TestSyncCoalesces(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		dir := t.TempDir()
		// The hive stops at the test's cleanup, inside the bubble.
		_, cp, alloc := syncHive(t, dir)
		ctx := t.Context()
		const callers = 64
		var want []identity.NumericIdentity
		for i := range callers {
			id, _, err := alloc.Allocate(ctx, cidr(prefixN(i)))
			if err != nil {
				t.Fatal(err)
			}
			want = append(want, id.ID)
		}
		// A write is running: the callers below all find it begun
		// before them, so it does not count for them.
		cp.wsem <- struct{}{}
		errs := make(chan error, callers)
		for range callers {
			go func() { errs <- cp.Sync(ctx) }()
		}
		synctest.Wait()
		<-cp.wsem
		for range callers {
			if err := <-errs; err != nil {
				t.Fatal(err)
			}
		}
		if w := cp.Status().Counters.Writes; w != 1 {
			t.Fatalf("%d concurrent Syncs wrote %d times, want 1", callers, w)
		}
		got := fileIDs(t, cp.Path())
		for _, id := range want {
			if !got[id] {
				t.Fatalf("checkpoint lacks identity %d", id)
			}
		}

		// A Sync whose context ends while it waits for the running
		// write gives up without writing.
		cp.wsem <- struct{}{}
		cctx, ccancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- cp.Sync(cctx) }()
		synctest.Wait()
		ccancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Fatalf("Sync with an ended context: %v", err)
		}
		<-cp.wsem
	})
}

// TestSyncBlockedFile checks that Sync fails, rather than reports a
// durability it does not have, when writing is disabled because a bad file
// could not be kept aside.
func TestSyncBlockedFile(t *testing.T) {
	dir := t.TempDir()
	_, cp, alloc := syncHive(t, dir)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	cp.mu.Lock()
	cp.blocked = errors.New("writing disabled: test")
	cp.mu.Unlock()
	if _, _, err := alloc.Allocate(ctx, cidr("10.2.0.0/16")); err != nil {
		t.Fatal(err)
	}
	if err := cp.Sync(ctx); err == nil {
		t.Fatal("Sync succeeded with writing disabled")
	}
	if _, err := os.Stat(filepath.Join(dir, FileName)); err == nil {
		t.Fatal("checkpoint written with writing disabled")
	}
	cp.mu.Lock()
	cp.blocked = nil
	cp.mu.Unlock()
}

func prefixN(i int) string { return fmt.Sprintf("10.3.%d.0/24", i) }

func cidr(s string) labels.Labels { return labels.FromPrefix(mustPrefix(s), false) }

// shellOf returns a script engine with the hive's commands, and its state.
func shellOf(t *testing.T, h *hive.Hive, dir string) (*script.Engine, *script.State) {
	t.Helper()
	cmds, err := h.ScriptCommands(hivetest.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	s, err := script.NewState(t.Context(), dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	return &script.Engine{Cmds: cmds}, s
}

// TestAllocateNotDurable checks that identity/allocate of a local label set
// fails when the checkpoint cannot be written, and drops the reference it
// took, so that a retry does not hold two.
func TestAllocateNotDurable(t *testing.T) {
	dir := t.TempDir()
	h, cp, alloc := syncHive(t, dir)
	e, s := shellOf(t, h, dir)
	cp.mu.Lock()
	cp.blocked = errors.New("writing disabled: test")
	cp.mu.Unlock()
	defer func() {
		cp.mu.Lock()
		cp.blocked = nil
		cp.mu.Unlock()
	}()
	if err := e.ExecuteLine(s, "identity/allocate cidr:10.4.0.0/16 reserved:world", io.Discard); err == nil {
		t.Fatal("identity/allocate succeeded although the checkpoint cannot be written")
	}
	if id := alloc.LookupByLabels(cidr("10.4.0.0/16")); id != nil {
		t.Fatalf("identity %d kept after the failed command", id.ID)
	}
	// --no-wait answers without the checkpoint.
	if err := e.ExecuteLine(s, "identity/allocate --no-wait cidr:10.4.0.0/16 reserved:world", io.Discard); err != nil {
		t.Fatal(err)
	}
}

// stallFsync makes the checkpoint's writes hang at their fsync until
// answer is called; stalled is closed when the first write gets there.
// answer returns once the stalled write has ended, with the disk working
// again.
func stallFsync(cp *Checkpoint) (stalled <-chan struct{}, answer func()) {
	reached, resume := make(chan struct{}), make(chan struct{})
	var reachOnce, resumeOnce sync.Once
	fault := func(step string) error {
		if step == "fsync" {
			reachOnce.Do(func() { close(reached) })
			<-resume
		}
		return nil
	}
	cp.mu.Lock()
	cp.fault = fault
	cp.mu.Unlock()
	// A durable answer writes the journal, not the whole checkpoint.
	cp.jfault.Store(&fault)
	return reached, func() {
		resumeOnce.Do(func() { close(resume) })
		cp.jfault.Store(nil)
		cp.mu.Lock() // held by the stalled write until it ends
		cp.fault = nil
		cp.mu.Unlock()
	}
}

// TestAllocateDiskStalled checks that identity/allocate of a local label
// set answers within --identity-allocation-timeout when the checkpoint's
// fsync hangs: it fails, drops its reference, and the write that was
// running still puts what it holds on disk once the disk answers.
func TestAllocateDiskStalled(t *testing.T) {
	dir := t.TempDir()
	const timeout = time.Second
	h, cp, alloc := syncHive(t, dir, func(h *hive.Hive) {
		hive.AddConfigOverride(h, func(c *allocator.Config) { c.IdentityAllocationTimeout = timeout })
	})
	e, s := shellOf(t, h, dir)
	stalled, answer := stallFsync(cp)
	defer answer()

	start := time.Now()
	err := e.ExecuteLine(s, "identity/allocate cidr:10.5.0.0/16 reserved:world", io.Discard)
	took := time.Since(start)
	if err == nil {
		t.Fatal("identity/allocate succeeded while the checkpoint's fsync hung")
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("error %v, want one that wraps context.DeadlineExceeded", err)
	}
	if want := "not durable within --identity-allocation-timeout (1s), reference dropped"; !strings.Contains(err.Error(), want) {
		t.Errorf("error %q does not say %q", err, want)
	}
	// The bound plus what a loaded machine adds; the fsync hangs until
	// the end of the test.
	if took > timeout+5*time.Second {
		t.Errorf("identity/allocate answered after %s, more than --identity-allocation-timeout (%s)", took, timeout)
	}
	select {
	case <-stalled:
	default:
		t.Fatal("the command failed before the write reached fsync")
	}
	if id := alloc.LookupByLabels(cidr("10.5.0.0/16")); id != nil {
		t.Fatalf("identity %d kept after the failed command", id.ID)
	}

	// The disk answers: the stalled write ends, and the next Sync writes
	// again.
	answer()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	id, _, err := alloc.Allocate(ctx, cidr("10.6.0.0/16"))
	if err != nil {
		t.Fatal(err)
	}
	if err := cp.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	if !fileIDs(t, filepath.Join(dir, FileName))[id.ID] {
		t.Fatalf("identity %d not in the checkpoint after the disk answered", id.ID)
	}
}

// TestUpsertDiskStalled checks that ipcache/upsert of a prefix with a local
// identity answers within --identity-allocation-timeout when the
// checkpoint's fsync hangs, as identity/allocate does: it fails with an
// error that names the bound and the checkpoint, the table keeps the row
// (the upsert stays applied), and once the disk answers the pair reaches
// the checkpoint.
func TestUpsertDiskStalled(t *testing.T) {
	dir := t.TempDir()
	const timeout = time.Second
	var (
		cp  *Checkpoint
		ipc *ipcache.IPCache
	)
	h := hive.New(
		cell.SimpleHealthCell, job.Cell, statedb.Cell, allocator.Cell, statedir.Cell, Cell, ipcache.Cell,
		cell.Invoke(func(c *Checkpoint, i *ipcache.IPCache) { cp, ipc = c, i }),
	)
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(h, func(c *Config) { c.IdentityCheckpointInterval = time.Hour })
	hive.AddConfigOverride(h, func(c *allocator.Config) { c.IdentityAllocationTimeout = timeout })
	hive.AddConfigOverride(h, func(c *ipcache.Config) { c.IPCacheMap = string(ipcache.MapKindFile) })
	testhive.Start(t, h)
	e, s := shellOf(t, h, dir)

	stalled, answer := stallFsync(cp)
	// The disk answers before the hive stops, whatever the test's outcome.
	defer answer()

	p := mustPrefix("10.5.0.0/16")
	start := time.Now()
	done := make(chan error, 1)
	go func() { done <- e.ExecuteLine(s, "ipcache/upsert "+p.String(), io.Discard) }()
	var err error
	// The bound plus what a loaded machine adds; the fsync hangs until
	// the disk answers below.
	select {
	case err = <-done:
	case <-time.After(timeout + 5*time.Second):
		answer()
		<-done
		t.Fatalf("ipcache/upsert gave no answer within %s while the checkpoint's fsync hung (--identity-allocation-timeout %s)", time.Since(start), timeout)
	}
	if err == nil {
		t.Fatal("ipcache/upsert succeeded while the checkpoint's fsync hung")
	}
	t.Logf("ipcache/upsert answered after %s: %v", time.Since(start), err)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("error %v, want one that wraps context.DeadlineExceeded", err)
	}
	for _, want := range []string{
		"applied to the ipcache table, but not durable within --identity-allocation-timeout (1s)",
		"local identities not in the checkpoint",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	select {
	case <-stalled:
	default:
		t.Fatal("the command failed before the checkpoint's write reached fsync")
	}
	row, ok := ipc.LookupPrefix(p)
	if !ok || !row.Identity.HasLocalScope() {
		t.Fatalf("row of %s after the failed command: %v (present %v), want one with a local identity", p, row, ok)
	}

	// The disk answers: the stalled write ends, and the pair becomes
	// durable.
	answer()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	if err := ipc.WaitDurable(ctx, p); err != nil {
		t.Fatal(err)
	}
	if !fileIDs(t, filepath.Join(dir, FileName))[row.Identity] {
		t.Fatalf("identity %d of %s not in the checkpoint after the disk answered", row.Identity, p)
	}
}

// TestWriteCommandInterruptible checks that checkpoint/write on a stalled
// disk ends when its client gives up (the shell ends the command's context
// when the client closes its connection), and that the write it started
// lands once the disk answers.
func TestWriteCommandInterruptible(t *testing.T) {
	dir := t.TempDir()
	h, cp, alloc := syncHive(t, dir)
	cmds, err := h.ScriptCommands(hivetest.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	ctx, giveUp := context.WithCancel(t.Context())
	s, err := script.NewState(ctx, dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	id, _, err := alloc.Allocate(t.Context(), cidr("10.7.0.0/16"))
	if err != nil {
		t.Fatal(err)
	}
	stalled, answer := stallFsync(cp)
	defer answer()
	done := make(chan error, 1)
	go func() { done <- (&script.Engine{Cmds: cmds}).ExecuteLine(s, "checkpoint/write", io.Discard) }()
	select {
	case <-stalled:
	case <-time.After(30 * time.Second):
		t.Fatal("checkpoint/write did not reach fsync")
	}
	giveUp()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("checkpoint/write after its client gave up: %v, want one that wraps context.Canceled", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("checkpoint/write still waits 10s after its client gave up")
	}
	answer()
	if !fileIDs(t, filepath.Join(dir, FileName))[id.ID] {
		t.Fatalf("identity %d not in the checkpoint once the disk answered", id.ID)
	}
}

// TestTriggeredWriteRetried: a triggered write that fails for a full disk
// is tried again by itself (after a second, then every two), so the
// checkpoint catches up as soon as the disk has room, without waiting for
// another change.
func TestTriggeredWriteRetried(t *testing.T) {
	dir := t.TempDir()
	cp, id, failures := allocateOnFullDisk(t, dir)
	eventually.True(t, "a triggered write failed", func() bool { return failures.Load() > 0 })
	cp.mu.Lock()
	cp.fault = nil
	cp.mu.Unlock()
	eventually.True(t, "the checkpoint holds the identity", func() bool {
		return fileIDs(t, filepath.Join(dir, FileName))[id.ID]
	})
}

// allocateOnFullDisk starts a checkpoint in dir whose writes fail as on a
// full disk (counted in failures) until its fault is cleared, and
// allocates a local identity, which triggers a write.
func allocateOnFullDisk(t *testing.T, dir string) (*Checkpoint, *identity.Identity, *atomic.Int32) {
	t.Helper()
	_, cp, alloc := syncHiveEvery(t, dir, 50*time.Millisecond)
	failures := new(atomic.Int32)
	cp.mu.Lock()
	cp.fault = func(step string) error {
		if step == "write" {
			failures.Add(1)
			return syscall.ENOSPC
		}
		return nil
	}
	cp.mu.Unlock()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	id, _, err := alloc.Allocate(ctx, cidr("10.7.0.0/16"))
	if err != nil {
		t.Fatal(err)
	}
	return cp, id, failures
}

// TestTriggeredWriteRetriedPromptly: however long the disk stayed full, the
// next attempt is at most maxRetry away, so the checkpoint (and readiness,
// which its failure took away) comes back within a few seconds of the disk
// having room again, not after a doubled pause of 16 s or more.
func TestTriggeredWriteRetriedPromptly(t *testing.T) {
	dir := t.TempDir()
	cp, id, failures := allocateOnFullDisk(t, dir)
	// Four failed attempts: the pauses between them have grown to their
	// bound.
	eventually.Within(t, time.Minute, "four triggered writes failed", func() bool { return failures.Load() >= 4 })
	cp.mu.Lock()
	cp.fault = nil
	cp.mu.Unlock()
	freed := time.Now()
	// The file itself, not the journal, which holds the identity since
	// the first attempt.
	eventually.Within(t, time.Minute, "the checkpoint file holds the identity", func() bool {
		res, err := Loader{}.Load(filepath.Join(dir, FileName))
		return err == nil && slices.ContainsFunc(res.Identities, func(i identity.Identity) bool { return i.ID == id.ID })
	})
	took := time.Since(freed)
	t.Logf("written %v after the disk had room again", took.Round(time.Millisecond))
	if took > 5*time.Second {
		t.Fatalf("written %v after the disk had room again, want a few seconds at most", took)
	}
}
