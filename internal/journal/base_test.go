package journal

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func openOver(t *testing.T, path string, base Base) (*Journal, Opened) {
	t.Helper()
	j, op, err := Open(path, testKind, base, time.Unix(2000, 0))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { j.Close() })
	return j, op
}

// TestOtherSnapshot: a journal whose header names another snapshot than
// the one read (the snapshot was replaced) is damage: a copy is kept, its
// records are returned to be replayed over the snapshot read, and the
// file is rewritten to hold them over that snapshot.
func TestOtherSnapshot(t *testing.T) {
	path := filepath.Join(t.TempDir(), "j")
	old, replaced := BaseOf([]byte("old snapshot")), BaseOf([]byte("replaced snapshot"))
	j, _ := openOver(t, path, old)
	for i := range 3 {
		j.Append(payload(i))
	}
	if err := j.Sync(3); err != nil {
		t.Fatal(err)
	}
	j.Close()
	orig, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}

	j, op := openOver(t, path, replaced)
	if !errors.Is(op.Damage, ErrOtherSnapshot) {
		t.Fatalf("journal over a replaced snapshot: damage %v", op.Damage)
	}
	checkRecords(t, op.Records, 3)
	kept, err := os.ReadFile(op.KeptAs)
	if err != nil || !bytes.Equal(kept, orig) {
		t.Fatalf("copy kept as %q: %v, equal %v", op.KeptAs, err, bytes.Equal(kept, orig))
	}
	j.Append(payload(3))
	if err := j.Sync(1); err != nil {
		t.Fatal(err)
	}
	j.Close()
	_, op = openOver(t, path, replaced)
	if op.Damage != nil {
		t.Fatal(op.Damage)
	}
	checkRecords(t, op.Records, 4)
}

// TestCoveredBySnapshot: a crash after Compact wrote its snapshot but
// before the journal was emptied (the reset fails here, as a kill at that
// moment leaves it) leaves a journal over the previous snapshot that ends
// with a successor record naming the new one: over the new snapshot it is
// no damage (no copy, nothing to replay); over the previous one its
// records are replayed as usual; over any other it is damage.
func TestCoveredBySnapshot(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "j")
	prev, next := BaseOf([]byte("previous")), BaseOf([]byte("next"))
	j, _ := openOver(t, path, prev)
	j.Append(payload(0))
	if err := j.Sync(1); err != nil {
		t.Fatal(err)
	}
	// Records 1 and 2 are pending when the snapshot is taken: the flush
	// writes them before the successor record.
	j.Append(payload(1))
	j.Append(payload(2))
	j.Fault = func(step string) error {
		if step == "truncate" {
			return errors.New("killed")
		}
		return nil
	}
	err := j.Compact(func(flush func(uint64, Base)) (uint64, Base, error) {
		flush(3, next)
		return 3, next, nil
	})
	if err == nil {
		t.Fatal("Compact hid the failed reset")
	}
	j.Close()
	saved := mustReadFile(t, path)

	j, op := openOver(t, path, next)
	if op.Damage != nil || op.KeptAs != "" || len(op.Records) != 0 || op.Covered != 3 {
		t.Fatalf("journal covered by the snapshot: %+v", op)
	}
	j.Close()
	if c := Decode(mustReadFile(t, path), testKind); c.Base != next || len(c.Records) != 0 || c.Damage != nil {
		t.Fatalf("after open: base %v, %d records, damage %v", c.Base, len(c.Records), c.Damage)
	}
	if kept, _ := filepath.Glob(path + ".corrupt-*"); len(kept) != 0 {
		t.Fatalf("copies kept: %v", kept)
	}

	// Over the previous snapshot (the snapshot's rename did not happen):
	// the records, without the successor record.
	if err := os.WriteFile(path, saved, 0o600); err != nil {
		t.Fatal(err)
	}
	j, op = openOver(t, path, prev)
	if op.Damage != nil {
		t.Fatal(op.Damage)
	}
	checkRecords(t, op.Records, 3)
	j.Close()

	if err := os.WriteFile(path, saved, 0o600); err != nil {
		t.Fatal(err)
	}
	_, op = openOver(t, path, BaseOf([]byte("other")))
	if !errors.Is(op.Damage, ErrOtherSnapshot) || op.KeptAs == "" || op.Covered != 0 {
		t.Fatalf("journal over another snapshot: %+v", op)
	}
	checkRecords(t, op.Records, 3)
}

func mustReadFile(t *testing.T, path string) []byte {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// TestOtherSnapshotWithoutRecords: a header naming another snapshot over
// no record (a crash between a snapshot and the journal's reset) is no
// damage: only the header is replaced.
func TestOtherSnapshotWithoutRecords(t *testing.T) {
	path := filepath.Join(t.TempDir(), "j")
	j, _ := openOver(t, path, BaseOf([]byte("a")))
	j.Close()
	_, op := openOver(t, path, BaseOf([]byte("b")))
	if op.Damage != nil || op.KeptAs != "" {
		t.Fatalf("bare header of another snapshot: %+v", op)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if c := Decode(data, testKind); c.Base != BaseOf([]byte("b")) || c.Damage != nil {
		t.Fatalf("header after open: %+v", c)
	}
}

// TestCompactNamesSnapshot: after Compact the header names the snapshot
// it wrote, and the records appended since replay over that snapshot only.
func TestCompactNamesSnapshot(t *testing.T) {
	path := filepath.Join(t.TempDir(), "j")
	first, second := BaseOf([]byte("first")), BaseOf([]byte("second"))
	j, _ := openOver(t, path, first)
	j.Append(payload(100))
	if err := j.Compact(func(func(uint64, Base)) (uint64, Base, error) { return 1, second, nil }); err != nil {
		t.Fatal(err)
	}
	j.Append(payload(0))
	if err := j.Sync(2); err != nil {
		t.Fatal(err)
	}
	j.Close()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	saved := bytes.Clone(data)
	_, op := openOver(t, path, second)
	if op.Damage != nil {
		t.Fatal(op.Damage)
	}
	checkRecords(t, op.Records, 1)
	if err := os.WriteFile(path, saved, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, op := openOver(t, path, first); !errors.Is(op.Damage, ErrOtherSnapshot) || len(op.Records) != 1 {
		t.Fatalf("over the first snapshot: damage %v, %d records", op.Damage, len(op.Records))
	}
}

// TestResetFailureBreaksJournal: a journal that could not be emptied after
// a snapshot still names the old one, so it takes no record (at restart it
// would be replayed over a snapshot it does not follow) until a later
// Compact succeeds.
func TestResetFailureBreaksJournal(t *testing.T) {
	path := filepath.Join(t.TempDir(), "j")
	first, second, third := BaseOf([]byte("1")), BaseOf([]byte("2")), BaseOf([]byte("3"))
	j, _ := openOver(t, path, first)
	j.Append(payload(100))
	fail := true
	j.Fault = func(step string) error {
		if step == "truncate" && fail {
			return errors.New("disk error")
		}
		return nil
	}
	if err := j.Compact(func(func(uint64, Base)) (uint64, Base, error) { return 1, second, nil }); err == nil {
		t.Fatal("Compact hid the failed reset")
	}
	j.Append(payload(0))
	if err := j.Sync(2); !errors.Is(err, ErrBroken) {
		t.Fatalf("Sync of a journal not emptied after a snapshot: %v, want ErrBroken", err)
	}
	fail = false
	if err := j.Compact(func(func(uint64, Base)) (uint64, Base, error) { return 1, third, nil }); err != nil {
		t.Fatal(err)
	}
	if err := j.Sync(2); err != nil {
		t.Fatal(err)
	}
	j.Close()
	_, op := openOver(t, path, third)
	if op.Damage != nil {
		t.Fatal(op.Damage)
	}
	checkRecords(t, op.Records, 1)
}

// TestVersion1: a bare header of format version 1 (a clean stop of an
// agent that wrote it) starts afresh silently; one with records, which
// names no snapshot, is kept aside and not replayed.
func TestVersion1(t *testing.T) {
	v1 := make([]byte, v1HeaderSize)
	copy(v1, magic[:])
	binary.LittleEndian.PutUint32(v1[8:], 1)
	binary.LittleEndian.PutUint32(v1[12:], testKind)

	path := filepath.Join(t.TempDir(), "j")
	if err := os.WriteFile(path, v1, 0o600); err != nil {
		t.Fatal(err)
	}
	j, op := openOver(t, path, Base{})
	if op.Damage != nil || op.KeptAs != "" || len(op.Records) != 0 {
		t.Fatalf("bare version 1 header: %+v", op)
	}
	j.Close()
	if data, _ := os.ReadFile(path); len(data) != HeaderSize || Decode(data, testKind).Damage != nil {
		t.Fatalf("header after opening a version 1 journal: %x", data)
	}

	path = filepath.Join(t.TempDir(), "j")
	if err := os.WriteFile(path, AppendRecord(bytes.Clone(v1), payload(0)), 0o600); err != nil {
		t.Fatal(err)
	}
	_, op = openOver(t, path, Base{})
	if !errors.Is(op.Damage, ErrOtherSnapshot) || len(op.Records) != 0 || op.KeptAs == "" {
		t.Fatalf("version 1 journal with records: %+v", op)
	}
}

// TestCrashBetweenCutAndHeader: Compact cuts the records before it names
// the new snapshot in the header; a crash in between (the header write
// fails here) leaves the old header over no record, which Open over the
// new snapshot starts afresh without damage. The records would have been
// kept aside, not replayed over the new snapshot, had the header changed
// first.
func TestCrashBetweenCutAndHeader(t *testing.T) {
	path := filepath.Join(t.TempDir(), "j")
	old, next := BaseOf([]byte("old")), BaseOf([]byte("next"))
	j, _ := openOver(t, path, old)
	j.Append(payload(0))
	if err := j.Sync(1); err != nil {
		t.Fatal(err)
	}
	j.Fault = func(step string) error {
		if step == "header" {
			return errors.New("crash")
		}
		return nil
	}
	if err := j.Compact(func(func(uint64, Base)) (uint64, Base, error) { return 1, next, nil }); err == nil {
		t.Fatal("Compact hid the failed header write")
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if c := Decode(data, testKind); c.Base != old || len(c.Records) != 0 || c.Damage != nil {
		t.Fatalf("after a crash before the header: base %v, %d records, damage %v", c.Base, len(c.Records), c.Damage)
	}
	j.Close()
	if _, op := openOver(t, path, next); op.Damage != nil || op.KeptAs != "" {
		t.Fatalf("open over the new snapshot: %+v", op)
	}
}
