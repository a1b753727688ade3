package restoration_test

import (
	"context"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive/hivetest"

	"github.com/identityd/identityd/cells/checkpoint"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/ipcachemap"
	"github.com/identityd/identityd/internal/journal"
	"github.com/identityd/identityd/internal/metricstest"
	"github.com/identityd/identityd/internal/testhive"
	"github.com/identityd/identityd/labels"
)

// upsertRecord is the identity journal's record of an allocation, as the
// checkpoint writes it: type 1, the ID, the canonical labels.
func upsertRecord(id identity.NumericIdentity, lbls labels.Labels) []byte {
	p := binary.LittleEndian.AppendUint32([]byte{1}, uint32(id))
	return append(p, lbls.CanonicalBytes()...)
}

// TestDamagedStateWithheld: a checkpoint, a journal damaged in the middle
// and the copy of an earlier damaged journal. Restoration restores the
// checkpoint, the journal's record before the damage and the one found
// intact after it; the number only the old copy names, and after damage
// every number not known to be free, are withheld until the release, so
// that new label sets get none of them; restore-status and the metric
// report the damage.
func TestDamagedStateWithheld(t *testing.T) {
	dir := t.TempDir()
	const first = identity.NumericIdentity(16777217)
	cp := checkpoint.AppendJSON(nil, []*identity.Identity{{ID: first, Labels: cidrSet(0)}})
	if err := checkpoint.WriteFile(filepath.Join(dir, checkpoint.FileName), cp); err != nil {
		t.Fatal(err)
	}
	jr := journal.Header(1, journal.BaseOf(cp))
	jr = journal.AppendRecord(jr, upsertRecord(first+1, cidrSet(1)))
	damagedAt := len(jr)
	jr = journal.AppendRecord(jr, upsertRecord(first+2, cidrSet(2)))
	jr = journal.AppendRecord(jr, upsertRecord(first+3, cidrSet(3)))
	jr[damagedAt+journal.RecordOverhead+2] ^= 0x20
	if err := os.WriteFile(filepath.Join(dir, checkpoint.JournalFileName), jr, 0o600); err != nil {
		t.Fatal(err)
	}
	old := journal.AppendRecord(journal.Header(1, journal.Base{}), upsertRecord(first+4, cidrSet(4)))
	if err := os.WriteFile(filepath.Join(dir, checkpoint.JournalFileName+".corrupt-1000"), old, 0o600); err != nil {
		t.Fatal(err)
	}

	a := startRestoringAgent(t, dir, time.Hour)
	defer a.stop(t)
	st := a.r.Status()
	if st.JournalDamage == nil || st.JournalDamage.Salvaged != 1 || st.JournalDamage.KeptAs == "" || st.JournalDamage.Records != 2 {
		t.Fatalf("journal damage %+v", st.JournalDamage)
	}
	// Withheld: first+4, which only the old copy names. The damaged
	// record's number (first+2) is named nowhere readable.
	if st.Counters.Restored != 3 || st.Counters.SeenWithheld != 1 || st.CopiesRead != 2 {
		t.Fatalf("status %+v", st)
	}
	// The damaged record's number, and those of any record lost with
	// it, are among the numbers withheld for being unknown: from the
	// first of each local scope to well above the highest seen.
	unknown := st.Counters.UnknownWithheld
	if unknown < 2*(1<<16) || !slices.Contains(a.alloc.Withheld(), first+2) {
		t.Fatalf("%d numbers withheld as unknown, %d among them: %v", unknown, first+2, slices.Contains(a.alloc.Withheld(), first+2))
	}
	for _, want := range []identity.NumericIdentity{first, first + 1, first + 3} {
		if id := a.alloc.LookupByID(want); id == nil {
			t.Fatalf("identity %d not restored", want)
		}
	}
	if !slices.Contains(a.alloc.Withheld(), first+4) {
		t.Fatalf("number %d of the kept copy not withheld: %v", first+4, a.alloc.Withheld())
	}
	// New label sets get none of the numbers the files name.
	named := []identity.NumericIdentity{first, first + 1, first + 2, first + 3, first + 4}
	for i := range 8 {
		id, _, err := a.alloc.Allocate(t.Context(), cidrSet(10+i))
		if err != nil {
			t.Fatal(err)
		}
		if slices.Contains(named, id.ID) {
			t.Fatalf("a new label set got %d, a number the state files name", id.ID)
		}
	}
	metricstest.Expect(t, metricstest.Scrape(t, a.srv.Addr()), map[string]float64{
		`identityd_identity_restoration_damage{what="journal_damaged"}`:          1,
		`identityd_identity_restoration_damage{what="journal_salvaged_records"}`: 1,
		`identityd_identity_restoration_damage{what="withheld_ids"}`:             1,
		`identityd_identity_restoration_damage{what="withheld_unknown_ids"}`:     float64(unknown),
	})
	if err := a.r.Release(t.Context()); err != nil {
		t.Fatal(err)
	}
	if slices.Contains(a.alloc.Withheld(), first+4) {
		t.Fatal("still withheld after the release")
	}
}

// TestJournalUnusableRefusesStart: an identity journal that cannot be
// opened (a directory in its place) refuses the start with one line
// naming it, instead of an agent that is ready and fails every durable
// answer.
func TestJournalUnusableRefusesStart(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, checkpoint.JournalFileName)
	if err := os.Mkdir(path, 0o700); err != nil {
		t.Fatal(err)
	}
	a := newAgent(t, dir, time.Hour, nil)
	log := hivetest.Logger(t)
	_, err := testhive.TryStart(t, a.h, log)
	if err == nil {
		t.Fatal("started with a directory in place of the identity journal")
	}
	// The hooks that started stop again, as the agent's own failed start
	// does.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_ = a.h.Stop(log, ctx)
	if !errors.Is(err, checkpoint.ErrJournalUnusable) || !strings.Contains(err.Error(), path) || strings.Contains(err.Error(), "\n") {
		t.Fatalf("start error %q, want one line naming %s", err, path)
	}
}

// cidrSet is the label set of the i-th test prefix, a node-local one.
func cidrSet(i int) labels.Labels {
	return labelsOf(prefixes(i + 1)[i])
}

// TestTornTailWithholdsNothingUnknown: a torn last record, as a crash
// during a write leaves, was never answered: the journal's valid records
// are restored and no number is withheld for being unknown.
func TestTornTailWithholdsNothingUnknown(t *testing.T) {
	dir := t.TempDir()
	const first = identity.NumericIdentity(16777217)
	jr := journal.Header(1, journal.Base{})
	jr = journal.AppendRecord(jr, upsertRecord(first, cidrSet(0)))
	jr = journal.AppendRecord(jr, upsertRecord(first+1, cidrSet(1)))
	if err := os.WriteFile(filepath.Join(dir, checkpoint.JournalFileName), jr[:len(jr)-3], 0o600); err != nil {
		t.Fatal(err)
	}
	a := startRestoringAgent(t, dir, time.Hour)
	defer a.stop(t)
	st := a.r.Status()
	if st.JournalDamage == nil || st.Counters.Restored != 1 || st.Counters.UnknownWithheld != 0 {
		t.Fatalf("status %+v, damage %+v", st, st.JournalDamage)
	}
}

// TestMapJournalDamageReported: a damaged journal of the datapath map file
// (here emptied) is reported in restore-status and the damage metric,
// beside the identity journal's; a sound one is not.
func TestMapJournalDamageReported(t *testing.T) {
	for _, damaged := range []bool{false, true} {
		dir := t.TempDir()
		writeMap(t, dir, nil)
		if damaged {
			if err := os.WriteFile(filepath.Join(dir, ipcachemap.FileName+ipcachemap.JournalSuffix), nil, 0o600); err != nil {
				t.Fatal(err)
			}
		}
		a := startRestoringAgent(t, dir, time.Hour)
		d := a.r.Status().MapJournalDamage
		if (d != nil) != damaged {
			t.Fatalf("damaged %v: restore-status reports %+v", damaged, d)
		}
		if damaged && !strings.Contains(d.Journal, "zero-length") {
			t.Errorf("the report %q does not say the journal was empty", d.Journal)
		}
		want := 0.0
		if damaged {
			want = 1
		}
		metricstest.Expect(t, metricstest.Scrape(t, a.srv.Addr()), map[string]float64{
			`identityd_identity_restoration_damage{what="map_journal_damaged"}`: want,
		})
		a.stop(t)
	}
}
