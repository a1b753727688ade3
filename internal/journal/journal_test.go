package journal

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

const testKind = 7

func open(t *testing.T, path string) (*Journal, Opened) {
	t.Helper()
	j, op, err := Open(path, testKind, Base{}, time.Unix(1000, 0))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { j.Close() })
	return j, op
}

func payload(i int) []byte { return []byte(fmt.Sprintf("record-%d", i)) }

func writeRecords(t *testing.T, path string, n int) {
	t.Helper()
	j, _ := open(t, path)
	for i := range n {
		j.Append(payload(i))
	}
	if err := j.Sync(j.Appended()); err != nil {
		t.Fatal(err)
	}
	j.Close()
}

func checkRecords(t *testing.T, got [][]byte, n int) {
	t.Helper()
	if len(got) != n {
		t.Fatalf("%d records, want %d", len(got), n)
	}
	for i, r := range got {
		if !bytes.Equal(r, payload(i)) {
			t.Fatalf("record %d is %q, want %q", i, r, payload(i))
		}
	}
}

func TestAppendSyncReopen(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "j")
	j, op := open(t, path)
	if op.Found || len(op.Records) != 0 || op.Damage != nil {
		t.Fatalf("new journal: %+v", op)
	}
	for i := range 10 {
		if seq := j.Append(payload(i)); seq != uint64(i+1) {
			t.Fatalf("seq %d, want %d", seq, i+1)
		}
	}
	if j.Durable() != 0 {
		t.Fatal("durable before Sync")
	}
	if err := j.Sync(5); err != nil {
		t.Fatal(err)
	}
	// One write covers every pending record.
	if j.Durable() != 10 {
		t.Fatalf("durable %d after Sync, want 10", j.Durable())
	}
	if n, _ := j.Pending(); n != 0 {
		t.Fatalf("%d records pending after Sync", n)
	}
	j.Append(payload(10))
	if err := j.Sync(11); err != nil {
		t.Fatal(err)
	}
	j.Close()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Fatalf("mode %v, want 0600", fi.Mode().Perm())
	}
	_, op = open(t, path)
	if !op.Found || op.Damage != nil || op.KeptAs != "" {
		t.Fatalf("reopen: %+v", op)
	}
	checkRecords(t, op.Records, 11)
}

// TestGroupCommit: callers that wait while a write runs share the next one.
func TestGroupCommit(t *testing.T) {
	j, _ := open(t, filepath.Join(t.TempDir(), "j"))
	var (
		mu     sync.Mutex
		writes int
		gate   = make(chan struct{})
		inside = make(chan struct{}, 1)
	)
	j.Fault = func(step string) error {
		if step == "write" {
			mu.Lock()
			writes++
			first := writes == 1
			mu.Unlock()
			if first {
				inside <- struct{}{}
				<-gate
			}
		}
		return nil
	}
	first := j.Append(payload(0))
	done := make(chan error, 1)
	go func() { done <- j.Sync(first) }()
	<-inside
	// 50 callers append and wait while the first write is held.
	var wg sync.WaitGroup
	errs := make(chan error, 50)
	for i := range 50 {
		seq := j.Append(payload(i + 1))
		wg.Go(func() { errs <- j.Sync(seq) })
	}
	time.Sleep(20 * time.Millisecond)
	close(gate)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if writes != 2 {
		t.Fatalf("%d writes for 51 records of 51 callers, want 2", writes)
	}
	j.Close()
	_, op := open(t, j.Path())
	checkRecords(t, op.Records, 51)
}

// TestFailedWriteIsUndone: a write that fails leaves no partial record and
// its records go out with the next write.
func TestFailedWriteIsUndone(t *testing.T) {
	path := filepath.Join(t.TempDir(), "j")
	j, _ := open(t, path)
	j.Append(payload(0))
	if err := j.Sync(1); err != nil {
		t.Fatal(err)
	}
	fail := errors.New("disk full")
	j.Fault = func(step string) error {
		if step == "fsync" {
			return fail
		}
		return nil
	}
	j.Append(payload(1))
	if err := j.Sync(2); !errors.Is(err, fail) {
		t.Fatalf("Sync with a failing fsync: %v", err)
	}
	if j.Durable() != 1 {
		t.Fatalf("durable %d after a failed write, want 1", j.Durable())
	}
	if fi, _ := os.Stat(path); fi.Size() != j.Size() {
		t.Fatalf("file has %d bytes after the failed write, journal counts %d", fi.Size(), j.Size())
	}
	j.Fault = nil
	j.Append(payload(2))
	if err := j.Sync(3); err != nil {
		t.Fatal(err)
	}
	j.Close()
	_, op := open(t, path)
	checkRecords(t, op.Records, 3)
}

func TestCompact(t *testing.T) {
	path := filepath.Join(t.TempDir(), "j")
	j, _ := open(t, path)
	for i := range 5 {
		j.Append(payload(i))
	}
	if err := j.Sync(3); err != nil {
		t.Fatal(err)
	}
	j.Append(payload(5)) // seq 6, pending
	j.Append(payload(6)) // seq 7, pending
	// A snapshot that holds records 1..6: record 7 must stay.
	if err := j.Compact(func(func(uint64, Base)) (uint64, Base, error) { return 6, Base{}, nil }); err != nil {
		t.Fatal(err)
	}
	if j.Durable() < 6 {
		t.Fatalf("durable %d after a snapshot of 6", j.Durable())
	}
	if j.Size() != HeaderSize {
		t.Fatalf("size %d after compaction", j.Size())
	}
	if n, _ := j.Pending(); n != 1 {
		t.Fatalf("%d records pending after compaction, want 1", n)
	}
	if err := j.Sync(7); err != nil {
		t.Fatal(err)
	}
	// A failed snapshot changes nothing.
	j.Append(payload(7))
	if err := j.Compact(func(func(uint64, Base)) (uint64, Base, error) { return 0, Base{}, errors.New("no space") }); err == nil {
		t.Fatal("failed snapshot compacted")
	}
	if err := j.Sync(8); err != nil {
		t.Fatal(err)
	}
	j.Close()
	_, op := open(t, path)
	if len(op.Records) != 2 || string(op.Records[0]) != "record-6" || string(op.Records[1]) != "record-7" {
		t.Fatalf("after compaction: %q", op.Records)
	}
}

// damaged opens a journal of 10 records damaged by damage and checks that
// the valid prefix is read, a copy of the whole file kept and the file cut
// so that new records follow the prefix.
func damaged(t *testing.T, damage func(data []byte) []byte, wantValid int, wantErr error, salvaged ...int) {
	t.Helper()
	dir := t.TempDir()
	path := filepath.Join(dir, "j")
	writeRecords(t, path, 10)
	orig, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	bad := damage(bytes.Clone(orig))
	if err := os.WriteFile(path, bad, 0o600); err != nil {
		t.Fatal(err)
	}
	j, op := open(t, path)
	if !errors.Is(op.Damage, wantErr) {
		t.Fatalf("damage %v, want %v", op.Damage, wantErr)
	}
	checkRecords(t, op.Records[:min(wantValid, len(op.Records))], wantValid)
	if got := op.Records[wantValid:]; len(got) != len(salvaged) || op.Salvaged != len(salvaged) {
		t.Fatalf("%d records salvaged (%d counted), want %v", len(got), op.Salvaged, salvaged)
	}
	for i, want := range salvaged {
		if !bytes.Equal(op.Records[wantValid+i], payload(want)) {
			t.Fatalf("salvaged record %d is %q, want %q", i, op.Records[wantValid+i], payload(want))
		}
	}
	if op.KeptAs == "" {
		t.Fatal("no copy kept of the damaged journal")
	}
	kept, err := os.ReadFile(op.KeptAs)
	if err != nil || !bytes.Equal(kept, bad) {
		t.Fatalf("kept copy %s differs from the damaged file (%v)", op.KeptAs, err)
	}
	if fi, _ := os.Stat(op.KeptAs); fi.Mode().Perm() != 0o600 {
		t.Fatalf("kept copy mode %v", fi.Mode().Perm())
	}
	// New records follow the valid prefix.
	j.Append([]byte("after"))
	if err := j.Sync(j.Appended()); err != nil {
		t.Fatal(err)
	}
	j.Close()
	_, op = open(t, path)
	if n := wantValid + len(salvaged); op.Damage != nil || len(op.Records) != n+1 || string(op.Records[n]) != "after" {
		t.Fatalf("after reopening: damage %v, %d records", op.Damage, len(op.Records))
	}
}

func TestTornLastRecord(t *testing.T) {
	damaged(t, func(d []byte) []byte { return d[:len(d)-3] }, 9, ErrTorn)
}

func TestTornLengthOfLastRecord(t *testing.T) {
	// Only 5 bytes of the last record's frame made it.
	n := RecordOverhead + len(payload(9))
	damaged(t, func(d []byte) []byte { return d[:len(d)-n+5] }, 9, ErrTorn)
}

func TestZeroedTail(t *testing.T) {
	damaged(t, func(d []byte) []byte { return append(d, make([]byte, 4096)...) }, 10, ErrTorn)
}

func TestFlippedByteInTheMiddle(t *testing.T) {
	// Inside record 5's payload: records 0..4 are valid.
	off := HeaderSize
	for i := range 5 {
		off += RecordOverhead + len(payload(i))
	}
	damaged(t, func(d []byte) []byte { d[off+RecordOverhead+2] ^= 0x40; return d }, 5, ErrChecksum, 6, 7, 8, 9)
}

// recordOffset is where record i of writeRecords' file begins.
func recordOffset(i int) int {
	off := HeaderSize
	for k := range i {
		off += RecordOverhead + len(payload(k))
	}
	return off
}

// TestCutInTheMiddle: bytes cut out of records 3 and 4 leave the records
// after them, found at their new offsets.
func TestCutInTheMiddle(t *testing.T) {
	damaged(t, func(d []byte) []byte {
		return append(d[:recordOffset(3)+5], d[recordOffset(4)+7:]...)
	}, 3, ErrChecksum, 5, 6, 7, 8, 9)
}

// TestGarbageInTheMiddle: records 2 to 4 overwritten with other bytes.
func TestGarbageInTheMiddle(t *testing.T) {
	damaged(t, func(d []byte) []byte {
		for i := recordOffset(2) + 3; i < recordOffset(5)-2; i++ {
			d[i] = byte(i*7 + 13)
		}
		return d
	}, 2, ErrBadLength, 5, 6, 7, 8, 9)
}

// TestDamagedHeader: a flipped byte in the header (here in the snapshot's
// size) keeps every record, salvaged.
func TestDamagedHeader(t *testing.T) {
	damaged(t, func(d []byte) []byte { d[17] ^= 0x01; return d }, 0, ErrChecksum, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
}

// TestDamagedVersion: a flipped bit that makes the version look newer is
// damage, told apart from a newer format by the header's checksum.
func TestDamagedVersion(t *testing.T) {
	damaged(t, func(d []byte) []byte { d[8] ^= 0x04; return d }, 0, ErrChecksum, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
}

// TestSalvageBounded: a large file of plausible lengths and no record is
// searched in time bounded by its size.
func TestSalvageBounded(t *testing.T) {
	data := Header(testKind, Base{})
	junk := make([]byte, 4<<20)
	for i := 0; i+4 <= len(junk); i += 4 {
		binary.LittleEndian.PutUint32(junk[i:], uint32(MaxRecord-i%1000))
	}
	data = append(data, junk...)
	t0 := time.Now()
	c := Decode(data, testKind)
	if len(c.Salvaged) != 0 || c.Lost != int64(len(junk)) {
		t.Fatalf("%d salvaged, %d lost of %d", len(c.Salvaged), c.Lost, len(junk))
	}
	t.Logf("searched %d bytes of plausible lengths in %v", len(junk), time.Since(t0))
}

func TestFlippedLength(t *testing.T) {
	off := HeaderSize + RecordOverhead + len(payload(0))
	damaged(t, func(d []byte) []byte { d[off+2] = 0xff; return d }, 1, ErrBadLength, 2, 3, 4, 5, 6, 7, 8, 9)
}

// resum gives a changed header its checksum again.
func resum(d []byte) []byte {
	binary.LittleEndian.PutUint32(d[28:], crc32.Checksum(d[:28], castagnoli))
	return d
}

func TestNewerVersion(t *testing.T) {
	damaged(t, func(d []byte) []byte { binary.LittleEndian.PutUint32(d[8:], Version+1); return resum(d) }, 0, ErrNewerVersion)
	// A newer format whose header is laid out otherwise.
	damaged(t, func(d []byte) []byte { binary.LittleEndian.PutUint32(d[8:], Version+1); d[28] ^= 0xff; return d }, 0, ErrNewerVersion)
}

func TestOtherKind(t *testing.T) {
	damaged(t, func(d []byte) []byte { binary.LittleEndian.PutUint32(d[12:], testKind+1); return resum(d) }, 0, ErrOtherKind)
}

func TestNotAJournal(t *testing.T) {
	damaged(t, func([]byte) []byte { return []byte("[{\"id\":1}]\n") }, 0, ErrNotJournal)
}

func TestTornHeader(t *testing.T) {
	damaged(t, func(d []byte) []byte { return d[:5] }, 0, ErrTorn)
}

// TestZeroLengthFile: a journal is created with its header, so an empty
// file is damage (its records are unknown), and it goes on afresh.
func TestZeroLengthFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "j")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	j, op := open(t, path)
	if !errors.Is(op.Damage, ErrEmpty) || op.KeptAs != "" || len(op.Records) != 0 || !op.Found {
		t.Fatalf("zero-length file: %+v", op)
	}
	j.Append(payload(0))
	if err := j.Sync(1); err != nil {
		t.Fatal(err)
	}
	j.Close()
	_, op = open(t, path)
	checkRecords(t, op.Records, 1)
}

// TestNotRegular: a directory at the journal's path is an error, and is
// left alone.
func TestNotRegular(t *testing.T) {
	path := filepath.Join(t.TempDir(), "j")
	if err := os.Mkdir(path, 0o700); err != nil {
		t.Fatal(err)
	}
	if _, _, err := Open(path, testKind, Base{}, time.Now()); err == nil {
		t.Fatal("opened a directory as a journal")
	}
}

func TestClosed(t *testing.T) {
	j, _ := open(t, filepath.Join(t.TempDir(), "j"))
	j.Close()
	j.Append(payload(0))
	if err := j.Sync(1); !errors.Is(err, ErrClosed) {
		t.Fatalf("Sync after Close: %v", err)
	}
}

func FuzzDecode(f *testing.F) {
	var good []byte
	good = append(good, Header(testKind, Base{})...)
	for i := range 3 {
		good = AppendRecord(good, payload(i))
	}
	f.Add(good)
	f.Add(good[:len(good)-2])
	f.Add([]byte{})
	f.Add(Header(testKind, Base{}))
	f.Add(append(Header(testKind, Base{}), make([]byte, 16)...))
	f.Fuzz(func(t *testing.T, data []byte) {
		c := Decode(data, testKind)
		if c.Valid < 0 || c.Valid > int64(len(data)) {
			t.Fatalf("valid prefix %d of %d bytes", c.Valid, len(data))
		}
		if (c.Damage == nil) != (c.Valid == int64(len(data))) {
			t.Fatalf("damage %v with %d of %d bytes valid", c.Damage, c.Valid, len(data))
		}
		// The valid prefix decodes to the same records without damage,
		// and re-encoding them gives the prefix back.
		if c.Valid >= HeaderSize {
			again := Decode(data[:c.Valid], testKind)
			if again.Damage != nil || len(again.Records) != len(c.Records) {
				t.Fatalf("valid prefix: damage %v, %d records, want %d", again.Damage, len(again.Records), len(c.Records))
			}
			enc := Header(testKind, c.Base)
			for _, r := range c.Records {
				enc = AppendRecord(enc, r)
			}
			if !bytes.Equal(enc, data[:c.Valid]) {
				t.Fatal("re-encoded records differ from the valid prefix")
			}
		}
	})
}
