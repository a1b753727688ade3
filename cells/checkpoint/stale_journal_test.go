package checkpoint

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/journal"
)

// TestJournalOverReplacedCheckpoint: after a crash, the checkpoint is
// replaced (an operator restores an older copy, another agent writes its
// own) while the journal of the changes made after the last checkpoint
// write lies beside it. Those records follow another state than the file
// now there, but each is the last durable state of its identity: they are
// replayed over the file found, every number they and the file name is
// in Seen, a copy of the journal is kept, the log says so, and the
// journal goes on over the file as found.
func TestJournalOverReplacedCheckpoint(t *testing.T) {
	dir := t.TempDir()
	_, cp, alloc := syncHive(t, dir)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	answer := func(prefix string) *identity.Identity {
		t.Helper()
		id, _, err := alloc.Allocate(ctx, cidr(prefix))
		if err != nil {
			t.Fatal(err)
		}
		if err := cp.SyncIdentities(ctx, id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	a := answer("10.61.0.0/16")
	if _, err := cp.Write(); err != nil {
		t.Fatal(err)
	}
	older := mustReadFile(t, filepath.Join(dir, FileName))
	b := answer("10.62.0.0/16")
	if _, err := cp.Write(); err != nil {
		t.Fatal(err)
	}
	// Released and allocated after the last checkpoint write: in the
	// journal only.
	if _, err := alloc.Release(ctx, a); err != nil {
		t.Fatal(err)
	}
	c := answer("10.63.0.0/16")

	crashed := copyState(t, dir)
	// Without the replacement, the journal is replayed.
	if got, _ := loadState(t, copyState(t, crashed)); len(got) != 2 || got[b.ID] == "" || got[c.ID] == "" {
		t.Fatalf("restored %v, want %d and %d", got, b.ID, c.ID)
	}

	if err := WriteFile(filepath.Join(crashed, FileName), older); err != nil {
		t.Fatal(err)
	}
	stale := mustReadFile(t, filepath.Join(crashed, JournalFileName))
	var logs lockedLog
	cp2, alloc2 := syncHiveLogs(t, crashed, &logs)
	res, err := cp2.Load()
	if err != nil {
		t.Fatal(err)
	}
	// a is released by the journal, c added; b was only in the
	// checkpoint replaced.
	if len(res.Identities) != 1 || res.Identities[0].ID != c.ID {
		t.Fatalf("restored %s, want only %d of the journal", describe(res.Identities), c.ID)
	}
	if !slices.Contains(res.Seen, a.ID) || !slices.Contains(res.Seen, c.ID) {
		t.Fatalf("numbers seen %v, want %d and %d", res.Seen, a.ID, c.ID)
	}
	rep := res.Report.Journal
	if !errors.Is(rep.Damage, journal.ErrOtherSnapshot) || rep.Records != 2 {
		t.Fatalf("journal report %+v, want another snapshot's journal, 2 records replayed", rep)
	}
	if kept, err := os.ReadFile(rep.KeptAs); err != nil || !bytes.Equal(kept, stale) {
		t.Fatalf("copy %q of the stale journal: %v", rep.KeptAs, err)
	}
	if l := logs.String(); !strings.Contains(l, "Identity journal follows another checkpoint than the one loaded") || !strings.Contains(l, rep.KeptAs) {
		t.Fatalf("no clear log line for the stale journal:\n%s", l)
	}
	// Tools reading the files see the same.
	if res, err := (Loader{}).LoadJournaled(filepath.Join(copyState(t, crashed), FileName)); err != nil || len(res.Identities) != 1 {
		t.Fatalf("LoadJournaled after the load: %v, %s", err, describe(res.Identities))
	}

	// The journal goes on over the checkpoint as found, with the records
	// replayed. (This hive restores nothing into its allocator: the new
	// identity may take an old number.)
	ctx2, cancel2 := context.WithTimeout(t.Context(), time.Minute)
	defer cancel2()
	d, _, err := alloc2.Allocate(ctx2, cidr("10.64.0.0/16"))
	if err != nil {
		t.Fatal(err)
	}
	if err := cp2.SyncIdentities(ctx2, d); err != nil {
		t.Fatal(err)
	}
	got, res3 := loadState(t, copyState(t, crashed))
	if res3.Report.Journal.Damage != nil || res3.Report.Journal.Records != 3 || got[d.ID] != d.Labels.String() {
		t.Fatalf("after going on: %+v, restored %v", res3.Report.Journal, got)
	}
}

// TestLoadJournaledOverReplacedCheckpoint: LoadJournaled, which reads the
// files without changing them, replays a journal over a checkpoint it does
// not follow and reports it, as Load does.
func TestLoadJournaledOverReplacedCheckpoint(t *testing.T) {
	dir := damagedJournalDir(t, func(d []byte) []byte { return d })
	path := filepath.Join(dir, FileName)
	if res, err := (Loader{}).LoadJournaled(path); err != nil || len(res.Identities) != 10 {
		t.Fatalf("journal over its checkpoint: %v, %d identities, want 10", err, len(res.Identities))
	}
	if err := WriteFile(path, AppendJSON(nil, cidrIdentities(3))); err != nil {
		t.Fatal(err)
	}
	res, err := (Loader{}).LoadJournaled(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Identities) != 8 || !errors.Is(res.Report.Journal.Damage, journal.ErrOtherSnapshot) {
		t.Fatalf("journal over a replaced checkpoint: %s, report %+v", describe(res.Identities), res.Report.Journal)
	}
}

// TestJournalNotEmptiedAfterWrite: a checkpoint write whose journal could
// not be emptied leaves a journal that names the old checkpoint, which a
// restart would keep aside. Answers then write the whole checkpoint
// instead of records that would not be replayed, and once a write empties
// the journal, they append records again.
func TestJournalNotEmptiedAfterWrite(t *testing.T) {
	dir := t.TempDir()
	_, cp, alloc := syncHive(t, dir)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	var failTruncate atomic.Bool
	failTruncate.Store(true)
	f := func(step string) error {
		if step == "truncate" && failTruncate.Load() {
			return errors.New("injected truncate failure")
		}
		return nil
	}
	cp.jfault.Store(&f)
	a, _, err := alloc.Allocate(ctx, cidr("10.71.0.0/16"))
	if err != nil {
		t.Fatal(err)
	}
	if err := cp.SyncIdentities(ctx, a); err != nil {
		t.Fatal(err)
	}
	if _, err := cp.Write(); err != nil {
		t.Fatalf("a checkpoint on disk with a journal not emptied failed the write: %v", err)
	}
	writes := cp.Status().Counters.Writes
	b, _, err := alloc.Allocate(ctx, cidr("10.72.0.0/16"))
	if err != nil {
		t.Fatal(err)
	}
	if err := cp.SyncIdentities(ctx, b); err != nil {
		t.Fatalf("answer with a journal not emptied: %v", err)
	}
	if w := cp.Status().Counters.Writes; w != writes+1 {
		t.Fatalf("%d checkpoint writes for the answer, want 1", w-writes)
	}
	if got, _ := loadState(t, copyState(t, dir)); got[a.ID] == "" || got[b.ID] == "" {
		t.Fatalf("restored %v, want %d and %d", got, a.ID, b.ID)
	}
	// The whole write emptied the journal: records again.
	failTruncate.Store(false)
	if _, err := cp.Write(); err != nil {
		t.Fatal(err)
	}
	writes = cp.Status().Counters.Writes
	c, _, err := alloc.Allocate(ctx, cidr("10.73.0.0/16"))
	if err != nil {
		t.Fatal(err)
	}
	if err := cp.SyncIdentities(ctx, c); err != nil {
		t.Fatal(err)
	}
	if w := cp.Status().Counters.Writes; w != writes {
		t.Fatalf("%d checkpoint writes for an answer with a working journal", w-writes)
	}
	if got, res := loadState(t, copyState(t, dir)); got[c.ID] == "" || res.Report.Journal.Records != 1 {
		t.Fatalf("restored %v with %d journal records, want %d from the journal", got, res.Report.Journal.Records, c.ID)
	}
}

// TestJournalOverCorruptCheckpoint: a checkpoint found corrupt is not the
// file the journal followed either: both are kept aside, the journal's
// records are replayed over the empty state the agent starts with, and
// the numbers of the corrupt file are not known.
func TestJournalOverCorruptCheckpoint(t *testing.T) {
	dir := damagedJournalDir(t, func(d []byte) []byte { return d })
	path := filepath.Join(dir, FileName)
	data := mustReadFile(t, path)
	if err := os.WriteFile(path, data[:len(data)/2], 0o600); err != nil {
		t.Fatal(err)
	}
	var logs lockedLog
	cp, _ := syncHiveLogs(t, dir, &logs)
	res, err := cp.Load()
	if err != nil {
		t.Fatal(err)
	}
	if res.Report.Corrupt == nil || res.Report.SetAside == "" {
		t.Fatalf("checkpoint report %+v, want corrupt and set aside", res.Report)
	}
	rep := res.Report.Journal
	if len(res.Identities) != 5 || !errors.Is(rep.Damage, journal.ErrOtherSnapshot) || rep.KeptAs == "" {
		t.Fatalf("restored %s, journal report %+v; want the journal's 5, the journal kept aside", describe(res.Identities), rep)
	}
	if !strings.Contains(logs.String(), "Identity journal follows another checkpoint") {
		t.Fatalf("no log line for the journal:\n%s", logs.String())
	}
}

// TestCrashBetweenWriteAndReset: a crash after a checkpoint write but
// before the journal was emptied (the reset fails here, as a SIGKILL at
// that moment leaves it) leaves a journal over the previous checkpoint
// whose records the new one holds: the restart restores everything, with
// no damage reported, no copy kept and no warning.
func TestCrashBetweenWriteAndReset(t *testing.T) {
	dir := t.TempDir()
	_, cp, alloc := syncHive(t, dir)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	var ids []*identity.Identity
	for _, p := range []string{"10.81.0.0/16", "10.82.0.0/16", "10.83.0.0/16"} {
		id, _, err := alloc.Allocate(ctx, cidr(p))
		if err != nil {
			t.Fatal(err)
		}
		if err := cp.SyncIdentities(ctx, id); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	if _, err := alloc.Release(ctx, ids[1]); err != nil {
		t.Fatal(err)
	}
	if err := cp.SyncIdentities(ctx, ids[0]); err != nil {
		t.Fatal(err)
	}
	f := func(step string) error {
		if step == "truncate" {
			return errors.New("killed")
		}
		return nil
	}
	cp.jfault.Store(&f)
	if _, err := cp.Write(); err != nil {
		t.Fatal(err)
	}
	crashed := copyState(t, dir)
	var logs lockedLog
	cp2, _ := syncHiveLogs(t, crashed, &logs)
	res, err := cp2.Load()
	if err != nil {
		t.Fatal(err)
	}
	rep := res.Report.Journal
	if rep.Damage != nil || rep.KeptAs != "" || rep.Covered == 0 || len(res.Identities) != 2 {
		t.Fatalf("journal report %+v, restored %s; want no damage, records covered, 2 identities", rep, describe(res.Identities))
	}
	if kept, _ := filepath.Glob(filepath.Join(crashed, JournalFileName+".corrupt-*")); len(kept) != 0 {
		t.Fatalf("copies kept: %v", kept)
	}
	if l := logs.String(); strings.Contains(l, "level=WARN") || strings.Contains(l, "level=ERROR") {
		t.Fatalf("warnings for a benign crash:\n%s", l)
	}
}
