package ipcachemap

import (
	"bytes"
	"errors"
	"os"
	"strings"
	"sync/atomic"
	"testing"
)

// TestJournalOverReplacedFile: the map file is replaced by an older copy
// while a journal of changes made after a later snapshot lies beside it.
// The journal follows that later snapshot, not the file now there, but
// each of its records is the last durable state of its key: they are
// replayed over the file found (an answered delete stays deleted, an
// answered upsert is kept), a copy is kept, a warning names it, and the
// journal goes on over the file as found.
func TestJournalOverReplacedFile(t *testing.T) {
	path := tempFilePath(t)
	entries := testEntries(30)
	m, _ := openJournaled(t, path, nil)
	if err := m.UpdateBatch(entries[:10]); err != nil {
		t.Fatal(err)
	}
	if err := m.Compact(); err != nil {
		t.Fatal(err)
	}
	older, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.UpdateBatch(entries[10:20]); err != nil {
		t.Fatal(err)
	}
	if err := m.Compact(); err != nil {
		t.Fatal(err)
	}
	// After the second snapshot: 20..29 added, 0 deleted, in the journal.
	if err := m.UpdateBatch(entries[20:]); err != nil {
		t.Fatal(err)
	}
	if err := m.Delete(entries[0].Key); err != nil {
		t.Fatal(err)
	}
	if err := m.Sync(); err != nil {
		t.Fatal(err)
	}

	crashed := crashCopy(t, path)
	// Without the replacement, the journal is replayed.
	_, info := openJournaled(t, crashCopy(t, crashed), nil)
	equalEntries(t, info.Snapshot, entries[1:])

	// An operator puts the older file back.
	if err := os.WriteFile(crashed, older, 0o600); err != nil {
		t.Fatal(err)
	}
	stale, err := os.ReadFile(crashed + JournalSuffix)
	if err != nil {
		t.Fatal(err)
	}
	m2, info := openJournaled(t, crashed, nil)
	// 10..19 were only in the file replaced.
	want := append(append([]Entry{}, entries[1:10]...), entries[20:]...)
	equalEntries(t, info.Snapshot, want)
	if info.JournalRecords != 11 {
		t.Fatalf("%d records of the stale journal replayed, want 11", info.JournalRecords)
	}
	kept, err := os.ReadFile(info.JournalKeptAs)
	if err != nil || !bytes.Equal(kept, stale) {
		t.Fatalf("copy %q of the stale journal: %v", info.JournalKeptAs, err)
	}
	if w := strings.Join(info.Warnings, "\n"); !strings.Contains(w, "map journal "+crashed+JournalSuffix+" follows another map file") {
		t.Fatalf("no warning names the stale journal: %q", info.Warnings)
	}
	// The journal goes on over the file as found.
	extra := testEntries(31)[30]
	if err := m2.Update(extra.Key, extra.Value); err != nil {
		t.Fatal(err)
	}
	if err := m2.Sync(); err != nil {
		t.Fatal(err)
	}
	_, info3 := openJournaled(t, crashCopy(t, crashed), nil)
	equalEntries(t, info3.Snapshot, append(want, extra))
	if info3.JournalKeptAs != "" || len(info3.Warnings) > 0 {
		t.Fatalf("journal over the file as found: kept %q, warnings %q", info3.JournalKeptAs, info3.Warnings)
	}
}

// TestJournalNotEmptiedFallsBackToFile: a journal that could not be
// emptied after a write of the file still names the old file, so records
// appended to it would not be replayed: SyncKeys writes the whole file
// instead, until a write empties the journal.
func TestJournalNotEmptiedFallsBackToFile(t *testing.T) {
	path := tempFilePath(t)
	var failTruncate atomic.Bool
	failTruncate.Store(true)
	m, _ := openJournaled(t, path, func(step string) error {
		if step == "truncate" && failTruncate.Load() {
			return errors.New("injected truncate failure")
		}
		return nil
	})
	entries := testEntries(12)
	if err := m.UpdateBatch(entries[:10]); err != nil {
		t.Fatal(err)
	}
	if err := m.Compact(); err == nil {
		t.Fatal("Compact hid the journal it could not empty")
	}
	if err := m.Update(entries[10].Key, entries[10].Value); err != nil {
		t.Fatal(err)
	}
	if err := m.SyncKeys([]Key{entries[10].Key}); err != nil {
		t.Fatalf("SyncKeys with a journal not emptied: %v", err)
	}
	_, info := openJournaled(t, crashCopy(t, path), nil)
	equalEntries(t, info.Snapshot, entries[:11])
	failTruncate.Store(false)
	if err := m.Update(entries[11].Key, entries[11].Value); err != nil {
		t.Fatal(err)
	}
	if err := m.SyncKeys([]Key{entries[11].Key}); err != nil {
		t.Fatal(err)
	}
	_, info = openJournaled(t, crashCopy(t, path), nil)
	equalEntries(t, info.Snapshot, entries)
	if info.JournalKeptAs != "" {
		t.Fatalf("journal kept aside after the fallback: %q", info.Warnings)
	}
}

// TestCrashBetweenSnapshotAndReset: a crash after the map file was written
// but before its journal was emptied (the reset fails here, as a kill at
// that moment leaves it), with changes pending and synced alike: the
// journal ends with a record naming the new file, which holds all its
// records, so the restart replays nothing, keeps no copy and warns of
// nothing, and every entry is there.
func TestCrashBetweenSnapshotAndReset(t *testing.T) {
	path := tempFilePath(t)
	var failTruncate atomic.Bool
	m, _ := openJournaled(t, path, func(step string) error {
		if step == "truncate" && failTruncate.Load() {
			return errors.New("killed")
		}
		return nil
	})
	entries := testEntries(12)
	if err := m.UpdateBatch(entries[:10]); err != nil {
		t.Fatal(err)
	}
	if err := m.Sync(); err != nil {
		t.Fatal(err)
	}
	// Pending at the snapshot: an update and a delete.
	if err := m.UpdateBatch(entries[10:]); err != nil {
		t.Fatal(err)
	}
	if err := m.Delete(entries[3].Key); err != nil {
		t.Fatal(err)
	}
	failTruncate.Store(true)
	if err := m.Compact(); err == nil {
		t.Fatal("Compact hid the journal it could not empty")
	}
	_, info := openJournaled(t, crashCopy(t, path), nil)
	equalEntries(t, info.Snapshot, append(append([]Entry{}, entries[:3]...), entries[4:]...))
	if info.JournalKeptAs != "" || len(info.Warnings) > 0 || info.JournalRecords != 0 {
		t.Fatalf("a crash between the snapshot and the reset: kept %q, %d records replayed, warnings %q",
			info.JournalKeptAs, info.JournalRecords, info.Warnings)
	}
}
