package checkpoint

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/eventually"
	"github.com/identityd/identityd/internal/journal"
	"github.com/identityd/identityd/internal/testhive"
)

// countJournalWrites counts the journal's fsyncs from now on.
func countJournalWrites(cp *Checkpoint) *atomic.Int64 {
	var n atomic.Int64
	f := func(step string) error {
		if step == "fsync" {
			n.Add(1)
		}
		return nil
	}
	cp.jfault.Store(&f)
	return &n
}

// copyState copies the checkpoint and its journal as they are on disk,
// as a crash would leave them.
func copyState(t *testing.T, from string) string {
	t.Helper()
	to := t.TempDir()
	for _, name := range []string{FileName, JournalFileName} {
		data, err := os.ReadFile(filepath.Join(from, name))
		if os.IsNotExist(err) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(to, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return to
}

// loadState loads the checkpoint of dir the way restoration does, in a
// hive of its own, and returns the identities by number.
func loadState(t *testing.T, dir string) (map[identity.NumericIdentity]string, LoadResult) {
	t.Helper()
	_, cp, _ := syncHive(t, dir)
	res, err := cp.Load()
	if err != nil {
		t.Fatal(err)
	}
	out := map[identity.NumericIdentity]string{}
	for _, id := range res.Identities {
		out[id.ID] = id.Labels.String()
	}
	return out, res
}

// TestDurableAnswerAppendsToJournal: a durable answer writes one journal
// record, not the checkpoint; a label set already held waits for no write;
// and what the answers made durable is restored from the checkpoint and
// the journal as a crash leaves them.
func TestDurableAnswerAppendsToJournal(t *testing.T) {
	dir := t.TempDir()
	_, cp, alloc := syncHive(t, dir)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	writes := countJournalWrites(cp)

	answered := map[identity.NumericIdentity]string{}
	for i := range 100 {
		lbls := cidr("10.7." + itoa(i) + ".0/24")
		id, _, err := alloc.Allocate(ctx, lbls)
		if err != nil {
			t.Fatal(err)
		}
		if err := cp.SyncIdentities(ctx, id); err != nil {
			t.Fatal(err)
		}
		answered[id.ID] = id.Labels.String()
	}
	if w := cp.Status().Counters.Writes; w != 0 {
		t.Fatalf("%d checkpoint writes for 100 durable answers with an interval of an hour, want 0", w)
	}
	if w := writes.Load(); w != 100 {
		t.Fatalf("%d journal writes for 100 answers of one caller, want 100", w)
	}
	// A label set the node already holds changes nothing on disk.
	before := writes.Load()
	id, allocated, err := alloc.Allocate(ctx, cidr("10.7.3.0/24"))
	if err != nil || allocated {
		t.Fatalf("second allocation: %v, new %v", err, allocated)
	}
	if err := cp.SyncIdentities(ctx, id); err != nil {
		t.Fatal(err)
	}
	if w := writes.Load(); w != before {
		t.Fatalf("a label set already held cost %d journal writes", w-before)
	}

	got, res := loadState(t, copyState(t, dir))
	if res.Report.Journal.Records != 100 || res.Report.Journal.Damage != nil {
		t.Fatalf("journal report %+v", res.Report.Journal)
	}
	for id, lbls := range answered {
		if got[id] != lbls {
			t.Errorf("identity %d: restored %q, answered %q", id, got[id], lbls)
		}
	}
}

func itoa(i int) string { return strconv.Itoa(i) }

// TestCheckpointWriteEmptiesJournal: a checkpoint write is the journal's
// snapshot: the journal is emptied, and changes after the write go on in
// it; the state restored is the same.
func TestCheckpointWriteEmptiesJournal(t *testing.T) {
	dir := t.TempDir()
	_, cp, alloc := syncHive(t, dir)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	var held []*identity.Identity
	for i := range 20 {
		id, _, err := alloc.Allocate(ctx, cidr("10.8."+itoa(i)+".0/24"))
		if err != nil {
			t.Fatal(err)
		}
		if err := cp.SyncIdentities(ctx, id); err != nil {
			t.Fatal(err)
		}
		held = append(held, id)
	}
	if _, err := cp.Write(); err != nil {
		t.Fatal(err)
	}
	jpath := filepath.Join(dir, JournalFileName)
	if fi, err := os.Stat(jpath); err != nil || fi.Size() != journal.HeaderSize {
		t.Fatalf("journal after a checkpoint write: %v, %v bytes", err, fi.Size())
	}
	// Release two, allocate one: three records after the snapshot.
	for _, id := range held[:2] {
		if _, err := alloc.Release(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	id, _, err := alloc.Allocate(ctx, cidr("10.9.0.0/16"))
	if err != nil {
		t.Fatal(err)
	}
	if err := cp.SyncIdentities(ctx, id); err != nil {
		t.Fatal(err)
	}
	got, res := loadState(t, copyState(t, dir))
	if len(got) != 19 || got[held[0].ID] != "" || got[held[1].ID] != "" || got[id.ID] == "" {
		t.Fatalf("restored %d identities (%v), want 19 without the two released", len(got), got)
	}
	if res.Report.Journal.Records != 3 {
		t.Fatalf("%d journal records after the snapshot, want 3", res.Report.Journal.Records)
	}
}

// damagedJournalDir writes a state directory whose checkpoint holds
// identities 1..5 and whose journal adds 6..10, then lets damage change the
// journal's bytes.
func damagedJournalDir(t *testing.T, damage func([]byte) []byte) string {
	t.Helper()
	dir := t.TempDir()
	ids := cidrIdentities(10)
	snap := AppendJSON(nil, ids[:5])
	if err := WriteFile(filepath.Join(dir, FileName), snap); err != nil {
		t.Fatal(err)
	}
	data := journal.Header(journalKind, journal.BaseOf(snap))
	for _, id := range ids[5:] {
		data = journal.AppendRecord(data, encodeRecord(nil, allocator.Change{Kind: allocator.ChangeUpsert, ID: id.ID, Labels: id.Labels}))
	}
	if err := os.WriteFile(filepath.Join(dir, JournalFileName), damage(data), 0o600); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestDamagedJournal: a torn last record, a flipped byte in the middle, a
// cut and an overwritten range, a damaged header, a zero-length file and a
// journal of a newer format: the load works with the checkpoint, the
// journal's valid records and those found intact after the damage, every
// number any of them names is in Seen, a copy of the damaged journal is
// kept, the log says so, and the journal goes on.
func TestDamagedJournal(t *testing.T) {
	recLen := journal.RecordOverhead + len(encodeRecord(nil, allocator.Change{ID: cidrIdentities(10)[9].ID, Labels: cidrIdentities(10)[9].Labels}))
	rec := func(i int) int { return journal.HeaderSize + i*recLen }
	cases := []struct {
		name     string
		damage   func([]byte) []byte
		want     int   // identities restored
		salvaged int   // journal records found after the damage
		err      error // the damage reported
		kept     bool  // a copy is kept
		log      string
	}{
		{"torn last record", func(d []byte) []byte { return d[:len(d)-3] }, 9, 0, journal.ErrTorn, true, "Identity journal damaged"},
		{"flipped byte in the middle", func(d []byte) []byte {
			d[rec(2)+journal.RecordOverhead+3] ^= 0x10
			return d
		}, 9, 2, journal.ErrChecksum, true, "Identity journal damaged"},
		{"cut in the middle", func(d []byte) []byte { return append(d[:rec(1)+5], d[rec(2)+9:]...) }, 8, 2, journal.ErrChecksum, true, "Identity journal damaged"},
		{"garbage in the middle", func(d []byte) []byte {
			for i := rec(1) + 2; i < rec(3)-1; i++ {
				d[i] = byte(i*31 + 7)
			}
			return d
		}, 8, 2, nil, true, "Identity journal damaged"},
		{"damaged header", func(d []byte) []byte { d[20] ^= 0x08; return d }, 10, 5, journal.ErrChecksum, true, "Identity journal damaged"},
		{"zero-length file", func([]byte) []byte { return nil }, 5, 0, journal.ErrEmpty, false, "Identity journal is empty"},
		{"newer format", func(d []byte) []byte {
			binary.LittleEndian.PutUint32(d[8:], journal.Version+1)
			binary.LittleEndian.PutUint32(d[28:], crc32.Checksum(d[:28], crc32.MakeTable(crc32.Castagnoli)))
			return d
		}, 5, 0, journal.ErrNewerVersion, true, "Identity journal damaged"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := damagedJournalDir(t, tc.damage)
			damaged, _ := os.ReadFile(filepath.Join(dir, JournalFileName))
			var logs lockedLog
			cp, alloc := syncHiveLogs(t, dir, &logs)
			res, err := cp.Load()
			if err != nil {
				t.Fatal(err)
			}
			if len(res.Identities) != tc.want {
				t.Fatalf("%d identities loaded, want %d", len(res.Identities), tc.want)
			}
			rep := res.Report.Journal
			if rep.Damage == nil || (tc.err != nil && !errors.Is(rep.Damage, tc.err)) || rep.Salvaged != tc.salvaged {
				t.Fatalf("journal report %+v, want damage %v and %d records salvaged", rep, tc.err, tc.salvaged)
			}
			if !strings.Contains(logs.String(), tc.log) {
				t.Fatalf("no clear log line for the damaged journal:\n%s", logs.String())
			}
			if tc.kept {
				kept, err := os.ReadFile(rep.KeptAs)
				if err != nil || !bytes.Equal(kept, damaged) {
					t.Fatalf("copy %q differs from the damaged journal (%v)", rep.KeptAs, err)
				}
				if !strings.Contains(logs.String(), rep.KeptAs) {
					t.Fatalf("the log does not name the copy:\n%s", logs.String())
				}
			}
			seen := map[identity.NumericIdentity]bool{}
			for _, id := range res.Seen {
				seen[id] = true
			}
			for _, id := range res.Identities {
				if !seen[id.ID] {
					t.Fatalf("restored identity %d not in Seen %v", id.ID, res.Seen)
				}
			}
			// The journal goes on after its valid records.
			ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
			defer cancel()
			id, _, err := alloc.Allocate(ctx, cidr("10.99.0.0/16"))
			if err != nil {
				t.Fatal(err)
			}
			if err := cp.SyncIdentities(ctx, id); err != nil {
				t.Fatal(err)
			}
			got, res2 := loadState(t, copyState(t, dir))
			if res2.Report.Journal.Damage != nil || got[id.ID] == "" {
				t.Fatalf("after the damaged load: %+v, identity %d restored: %v", res2.Report.Journal, id.ID, got[id.ID] != "")
			}
		})
	}
}

// lockedLog is a log the hive writes while the test reads it.
type lockedLog struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *lockedLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *lockedLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// syncHiveLogs is syncHive with the hive's logs in logs.
func syncHiveLogs(t *testing.T, dir string, logs *lockedLog) (*Checkpoint, allocator.Allocator) {
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
	hive.AddConfigOverride(h, func(c *Config) { c.IdentityCheckpointInterval = time.Hour })
	if _, err := testhive.TryStart(t, h, slog.New(slog.NewTextHandler(logs, nil))); err != nil {
		t.Fatal(err)
	}
	return cp, alloc
}

// TestConcurrentDurableAnswers: callers allocate and release concurrently,
// each waiting for SyncIdentities, while checkpoints are written (and the
// journal emptied) in between: whenever a caller's answer returns, a crash
// would restore its identity, and the state a crash leaves at the end is
// the allocator's.
func TestConcurrentDurableAnswers(t *testing.T) {
	dir := t.TempDir()
	_, cp, alloc := syncHive(t, dir)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	const callers, each = 8, 40
	stop := make(chan struct{})
	var snapshots sync.WaitGroup
	snapshots.Go(func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(5 * time.Millisecond):
			}
			if _, err := cp.Write(); err != nil {
				t.Error(err)
				return
			}
		}
	})
	var wg sync.WaitGroup
	for c := range callers {
		wg.Go(func() {
			for i := range each {
				id, _, err := alloc.Allocate(ctx, cidr(fmt.Sprintf("10.%d.%d.0/24", 50+c, i)))
				if err != nil {
					t.Error(err)
					return
				}
				if err := cp.SyncIdentities(ctx, id); err != nil {
					t.Error(err)
					return
				}
				if i%4 == 3 {
					// Released again: the journal records the release.
					if _, err := alloc.Release(ctx, id); err != nil {
						t.Error(err)
					}
				}
			}
		})
	}
	wg.Wait()
	close(stop)
	snapshots.Wait()
	// Every change is recorded once the allocator's events are in; one
	// more waited answer makes them durable.
	id, _, err := alloc.Allocate(ctx, cidr("10.49.0.0/16"))
	if err != nil {
		t.Fatal(err)
	}
	if err := cp.SyncIdentities(ctx, id); err != nil {
		t.Fatal(err)
	}
	want := map[identity.NumericIdentity]string{}
	for _, id := range alloc.LocalIdentities() {
		want[id.ID] = id.Labels.String()
	}
	eventually.Within(t, 10*time.Second, "the state a crash leaves equals the allocator's", func() bool {
		if err := cp.SyncIdentities(ctx, id); err != nil {
			t.Fatal(err)
		}
		j, _ := cp.openJournal()
		if err := j.Sync(j.Appended()); err != nil {
			t.Fatal(err)
		}
		got, _ := loadState(t, copyState(t, dir))
		return maps.Equal(got, want)
	})
}

// TestJournalNotRestored: in a hive without restoration nobody replays the
// journal, so its old records do not belong to the state this agent
// writes: the first durable answer keeps a copy of it aside and starts it
// afresh, instead of leaving old records to be replayed over a newer
// checkpoint.
func TestJournalNotRestored(t *testing.T) {
	dir := damagedJournalDir(t, func(d []byte) []byte { return d })
	old := mustReadFile(t, filepath.Join(dir, JournalFileName))
	var logs lockedLog
	cp, alloc := syncHiveLogs(t, dir, &logs)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	id, _, err := alloc.Allocate(ctx, cidr("10.98.0.0/16"))
	if err != nil {
		t.Fatal(err)
	}
	if err := cp.SyncIdentities(ctx, id); err != nil {
		t.Fatal(err)
	}
	kept, _ := filepath.Glob(filepath.Join(dir, JournalFileName+".unrestored-*"))
	if len(kept) != 1 || !bytes.Equal(mustReadFile(t, kept[0]), old) {
		t.Fatalf("copies of the unrestored journal: %v", kept)
	}
	if !strings.Contains(logs.String(), "Identity journal not restored") {
		t.Fatalf("no log line for the unrestored journal:\n%s", logs.String())
	}
	c := journal.Decode(mustReadFile(t, filepath.Join(dir, JournalFileName)), journalKind)
	if c.Damage != nil || len(c.Records) != 1 {
		t.Fatalf("journal after the first answer: %d records, damage %v; want only the new one", len(c.Records), c.Damage)
	}
}

func mustReadFile(t *testing.T, path string) []byte {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// TestDurableAnswerDuringCheckpointWrite: while a checkpoint write hangs
// at its fsync, an answer for a label set already durable returns at once
// instead of waiting for the disk's answer to the whole file.
func TestDurableAnswerDuringCheckpointWrite(t *testing.T) {
	dir := t.TempDir()
	_, cp, alloc := syncHive(t, dir)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	held, _, err := alloc.Allocate(ctx, cidr("10.97.0.0/16"))
	if err != nil {
		t.Fatal(err)
	}
	if err := cp.SyncIdentities(ctx, held); err != nil {
		t.Fatal(err)
	}
	reached, resume := make(chan struct{}), make(chan struct{})
	var once sync.Once
	cp.mu.Lock()
	cp.fault = func(step string) error {
		if step == "fsync" {
			once.Do(func() { close(reached) })
			<-resume
		}
		return nil
	}
	cp.mu.Unlock()
	written := make(chan error, 1)
	go func() {
		_, err := cp.Write()
		written <- err
	}()
	<-reached
	again, allocated, err := alloc.Allocate(ctx, cidr("10.97.0.0/16"))
	if err != nil || allocated {
		t.Fatalf("allocate a held label set: %v, new %v", err, allocated)
	}
	done := make(chan error, 1)
	go func() { done <- cp.SyncIdentities(ctx, again) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		close(resume)
		t.Fatal("an answer already durable waited for the running checkpoint write")
	}
	close(resume)
	if err := <-written; err != nil {
		t.Fatal(err)
	}
	cp.mu.Lock()
	cp.fault = nil
	cp.mu.Unlock()
}
