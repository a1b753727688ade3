package ipcachemap

import (
	"bytes"
	"encoding/binary"
	"hash/crc32"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/identityd/identityd/internal/journal"
)

func openJournaled(t testing.TB, path string, fault func(string) error) (Map, OpenInfo) {
	t.Helper()
	m, info, err := Open(Config{Kind: KindFile, FilePath: path, MaxEntries: 1 << 20, Journal: true, WriteFault: fault})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m, info
}

// crashCopy copies the map file and its journal as they are on disk, as a
// crash of the agent would leave them, and returns the copy's map path.
func crashCopy(t *testing.T, path string) string {
	t.Helper()
	to := tempFilePath(t)
	for _, suffix := range []string{"", JournalSuffix} {
		data, err := os.ReadFile(path + suffix)
		if os.IsNotExist(err) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(to+suffix, data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return to
}

// TestJournalSyncAppends: with a journal, Sync writes the changes, not the
// whole file; a crash right after keeps them (file + journal replayed), a
// key already durable costs no write, and Compact writes the file and
// empties the journal.
func TestJournalSyncAppends(t *testing.T) {
	path := tempFilePath(t)
	var fsyncs int
	fault := func(step string) error {
		if step == "fsync" {
			fsyncs++
		}
		return nil
	}
	m, _ := openJournaled(t, path, fault)
	entries := testEntries(100)
	if err := m.UpdateBatch(entries[:50]); err != nil {
		t.Fatal(err)
	}
	if err := m.Compact(); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(path + JournalSuffix); err != nil || fi.Size() != journal.HeaderSize {
		t.Fatalf("journal after Compact: %v", err)
	}
	fileBefore, _ := os.ReadFile(path)
	for _, e := range entries[50:] {
		if err := m.Update(e.Key, e.Value); err != nil {
			t.Fatal(err)
		}
		if err := m.SyncKeys([]Key{e.Key}); err != nil {
			t.Fatal(err)
		}
	}
	if err := m.Delete(entries[0].Key); err != nil {
		t.Fatal(err)
	}
	if err := m.SyncKeys([]Key{entries[0].Key}); err != nil {
		t.Fatal(err)
	}
	if fileAfter, _ := os.ReadFile(path); !bytes.Equal(fileBefore, fileAfter) {
		t.Fatal("durable changes rewrote the map file")
	}
	// An entry already durable waits for no write.
	before := fsyncs
	if err := m.Update(entries[60].Key, entries[60].Value); err != nil {
		t.Fatal(err)
	}
	if err := m.SyncKeys([]Key{entries[60].Key}); err != nil {
		t.Fatal(err)
	}
	if fsyncs != before {
		t.Fatalf("an unchanged, durable entry cost %d fsyncs", fsyncs-before)
	}

	_, info := openJournaled(t, crashCopy(t, path), nil)
	equalEntries(t, info.Snapshot, entries[1:])
	if info.JournalRecords != 51 {
		t.Fatalf("%d journal records replayed, want 51", info.JournalRecords)
	}

	// Close compacts: the file holds everything, the journal nothing.
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	got, err := ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	equalEntries(t, got, entries[1:])
	if fi, _ := os.Stat(path + JournalSuffix); fi.Size() != journal.HeaderSize {
		t.Fatalf("journal of %d bytes after a clean close", fi.Size())
	}
}

// TestJournalDamaged: a torn last record, a flipped byte in the middle, a
// cut and an overwritten range, a damaged header, a zero-length journal
// and one of a newer format: the map opens with the file, the journal's
// valid records and those found intact after the damage, keeps a copy of
// the damaged journal, warns, and goes on after the records replayed.
func TestJournalDamaged(t *testing.T) {
	recLen := journal.RecordOverhead + 1 + KeySize + ValueSize
	rec := func(i int) int { return journal.HeaderSize + i*recLen }
	cases := []struct {
		name   string
		damage func([]byte) []byte
		lost   []int // the entries of the journal (10..19) not restored
		kept   bool
	}{
		{"torn last record", func(d []byte) []byte { return d[:len(d)-5] }, []int{19}, true},
		{"flipped byte in the middle", func(d []byte) []byte {
			d[rec(5)+journal.RecordOverhead+7] ^= 1
			return d
		}, []int{15}, true},
		{"cut in the middle", func(d []byte) []byte { return append(d[:rec(3)+11], d[rec(5)+2:]...) }, []int{13, 14, 15}, true},
		{"garbage in the middle", func(d []byte) []byte {
			for i := rec(2) + 1; i < rec(4); i++ {
				d[i] = byte(i*13 + 5)
			}
			return d
		}, []int{12, 13}, true},
		{"damaged header", func(d []byte) []byte { d[18] ^= 0x40; return d }, nil, true},
		{"zero-length file", func([]byte) []byte { return nil }, []int{10, 11, 12, 13, 14, 15, 16, 17, 18, 19}, false},
		{"newer format", func(d []byte) []byte {
			binary.LittleEndian.PutUint32(d[8:], journal.Version+1)
			binary.LittleEndian.PutUint32(d[28:], crc32.Checksum(d[:28], crc32.MakeTable(crc32.Castagnoli)))
			return d
		}, []int{10, 11, 12, 13, 14, 15, 16, 17, 18, 19}, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			path := tempFilePath(t)
			entries := testEntries(20)
			var want []Entry
			for i, e := range entries {
				if !slices.Contains(tc.lost, i) {
					want = append(want, e)
				}
			}
			m, _ := openJournaled(t, path, nil)
			if err := m.UpdateBatch(entries[:10]); err != nil {
				t.Fatal(err)
			}
			if err := m.Compact(); err != nil {
				t.Fatal(err)
			}
			if err := m.UpdateBatch(entries[10:]); err != nil {
				t.Fatal(err)
			}
			if err := m.Sync(); err != nil {
				t.Fatal(err)
			}
			crashed := crashCopy(t, path)
			data, _ := os.ReadFile(crashed + JournalSuffix)
			bad := tc.damage(data)
			if err := os.WriteFile(crashed+JournalSuffix, bad, 0o600); err != nil {
				t.Fatal(err)
			}
			m2, info := openJournaled(t, crashed, nil)
			equalEntries(t, info.Snapshot, want)
			if !strings.Contains(strings.Join(info.Warnings, "\n"), "map journal "+crashed+JournalSuffix+" damaged") {
				t.Fatalf("no warning names the damaged journal: %q", info.Warnings)
			}
			if info.JournalDamage == "" {
				t.Fatalf("OpenInfo does not report the damage: %+v", info)
			}
			if tc.kept {
				kept, err := os.ReadFile(info.JournalKeptAs)
				if err != nil || !bytes.Equal(kept, bad) {
					t.Fatalf("copy %q of the damaged journal: %v", info.JournalKeptAs, err)
				}
			}
			// New records follow the valid ones.
			extra := testEntries(21)[20]
			if err := m2.Update(extra.Key, extra.Value); err != nil {
				t.Fatal(err)
			}
			if err := m2.Sync(); err != nil {
				t.Fatal(err)
			}
			_, info3 := openJournaled(t, crashCopy(t, crashed), nil)
			equalEntries(t, info3.Snapshot, append(want, extra))
			if info3.JournalKeptAs != "" {
				t.Fatal("journal damaged again after going on")
			}
		})
	}
}

// BenchmarkJournaledSyncKeys: one change and its durability, with many
// entries in the map: the cost of one journal record, whatever the size.
func BenchmarkJournaledSyncKeys(b *testing.B) {
	for _, n := range []int{1000, 100_000} {
		b.Run(strconv.Itoa(n), func(b *testing.B) {
			path := tempFilePath(b)
			m, _ := openJournaled(b, path, nil)
			entries := testEntries(n + b.N)
			if err := m.UpdateBatch(entries[:n]); err != nil {
				b.Fatal(err)
			}
			if err := m.Compact(); err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			for i := range b.N {
				e := entries[n+i]
				if err := m.Update(e.Key, e.Value); err != nil {
					b.Fatal(err)
				}
				if err := m.SyncKeys([]Key{e.Key}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestJournalDamagedKeepsDeletes: deletes recorded after a damaged record
// are salvaged: an answered delete does not come back, nor is an answered
// upsert after the damage lost.
func TestJournalDamagedKeepsDeletes(t *testing.T) {
	path := tempFilePath(t)
	entries := testEntries(20)
	m, _ := openJournaled(t, path, nil)
	if err := m.UpdateBatch(entries[:10]); err != nil {
		t.Fatal(err)
	}
	if err := m.Compact(); err != nil {
		t.Fatal(err)
	}
	// Records: update 10, then deletes of 0..4, then updates 11..19.
	if err := m.Update(entries[10].Key, entries[10].Value); err != nil {
		t.Fatal(err)
	}
	for _, e := range entries[:5] {
		if err := m.Delete(e.Key); err != nil {
			t.Fatal(err)
		}
	}
	if err := m.UpdateBatch(entries[11:]); err != nil {
		t.Fatal(err)
	}
	if err := m.Sync(); err != nil {
		t.Fatal(err)
	}
	crashed := crashCopy(t, path)
	data, _ := os.ReadFile(crashed + JournalSuffix)
	// The first record (the update of 10) damaged.
	data[journal.HeaderSize+journal.RecordOverhead+3] ^= 0x80
	if err := os.WriteFile(crashed+JournalSuffix, data, 0o600); err != nil {
		t.Fatal(err)
	}
	_, info := openJournaled(t, crashed, nil)
	equalEntries(t, info.Snapshot, append(append([]Entry{}, entries[5:10]...), entries[11:]...))
}
