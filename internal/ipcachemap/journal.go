package ipcachemap

import (
	"errors"
	"fmt"
	"time"

	"github.com/identityd/identityd/internal/journal"
)

// JournalSuffix names the file backend's journal beside its file.
const JournalSuffix = ".journal"

// journalKind tells the map's journal records apart from the identity
// journal's.
const journalKind = 2

// Records of the map's journal: a type byte, the raw key, and for an
// update the raw value (the bytes the map file and the kernel hold).
const (
	recUpdate byte = 1
	recDelete byte = 2
)

func (f *fileMap) journalPath() string { return f.path + JournalSuffix }

// openJournal opens the journal and replays it over the entries read from
// the file, whose bytes have the journal.Base base. A damaged journal is
// replayed up to its last valid record and then with the records after
// the damage that still verify (each is the last durable state of its key
// when no later record names it: an answered delete stays deleted, an
// answered upsert is kept); one that follows another file is replayed
// over the file found, unless the file holds its records already (a crash
// between a snapshot and the journal's reset). info reports the damage.
// Called before the map is shared.
func (f *fileMap) openJournal(info *OpenInfo, base journal.Base) error {
	j, op, err := journal.Open(f.journalPath(), journalKind, base, time.Now())
	if err != nil {
		return fmt.Errorf("ipcache map journal: %w", err)
	}
	j.Fault = f.fault
	invalid := 0
	for _, r := range op.Records {
		if !f.replay(r) {
			invalid++
		}
	}
	switch {
	case errors.Is(op.Damage, journal.ErrOtherSnapshot):
		info.Warnings = append(info.Warnings, fmt.Sprintf(
			"map journal %s follows another map file than %s (replaced, lost or damaged since): replayed its %d records over the file found, what changed between the two is unknown; a copy of the file is kept as %s (%v)",
			f.journalPath(), f.path, len(op.Records), op.KeptAs, op.Damage))
		info.JournalKeptAs = op.KeptAs
	case errors.Is(op.Damage, journal.ErrEmpty):
		info.Warnings = append(info.Warnings, fmt.Sprintf(
			"map journal %s damaged (%v): the changes since the map file was written are unknown",
			f.journalPath(), op.Damage))
	case op.Damage != nil:
		info.Warnings = append(info.Warnings, fmt.Sprintf(
			"map journal %s damaged (%v): replayed its %d valid records, %d of them found intact after the damage (%d bytes lost), a copy of the file is kept as %s",
			f.journalPath(), op.Damage, len(op.Records), op.Salvaged, op.Lost, op.KeptAs))
		info.JournalKeptAs = op.KeptAs
	}
	if op.Damage != nil {
		info.JournalDamage = op.Damage.Error()
		info.JournalSalvaged, info.JournalLostBytes = op.Salvaged, op.Lost
	}
	if invalid > 0 {
		info.Warnings = append(info.Warnings, fmt.Sprintf("map journal %s: %d records skipped as invalid", f.journalPath(), invalid))
	}
	info.JournalRecords = len(op.Records)
	if len(op.Records) > 0 {
		// The next Compact writes them into the file.
		f.dirty = true
		info.Snapshot = rawEntries(f.entries)
		info.Reason += fmt.Sprintf(", replayed %d journal records", len(op.Records))
	}
	f.jrn = j
	f.pending = map[rawKey]uint64{}
	return nil
}

// replay applies one record to the entries; false for a record that is
// not one.
func (f *fileMap) replay(r []byte) bool {
	var rk rawKey
	switch {
	case len(r) == 1+KeySize && r[0] == recDelete:
		copy(rk[:], r[1:])
		delete(f.entries, rk)
	case len(r) == 1+KeySize+ValueSize && r[0] == recUpdate:
		var rv rawValue
		copy(rk[:], r[1:])
		copy(rv[:], r[1+KeySize:])
		f.entries[rk] = rv
	default:
		return false
	}
	return true
}

// logLocked appends the change of rk (rv nil: deleted) to the journal;
// mu held.
func (f *fileMap) logLocked(rk *rawKey, rv *rawValue) {
	if f.jrn == nil {
		return
	}
	if rv == nil {
		f.rec = append(append(f.rec[:0], recDelete), rk[:]...)
	} else {
		f.rec = append(append(append(f.rec[:0], recUpdate), rk[:]...), rv[:]...)
	}
	f.pending[*rk] = f.jrn.Append(f.rec)
}

// syncJournal makes the records up to seq durable and forgets the keys
// they changed. A journal that takes no record until the next snapshot
// (journal.ErrBroken) gets that snapshot now.
func (f *fileMap) syncJournal(seq uint64) error {
	err := f.jrn.Sync(seq)
	if errors.Is(err, journal.ErrBroken) {
		// The file written holds the records up to seq even when the
		// journal cannot be emptied after it (again).
		err = f.Compact()
		if err != nil && f.jrn.Durable() >= seq {
			err = nil
		}
	}
	if err != nil {
		return fmt.Errorf("ipcache map journal: %w", err)
	}
	f.forgetDurable()
	return nil
}

// forgetDurable drops the pending keys whose last record is durable.
func (f *fileMap) forgetDurable() {
	durable := f.jrn.Durable()
	f.mu.Lock()
	defer f.mu.Unlock()
	for k, seq := range f.pending {
		if seq <= durable {
			delete(f.pending, k)
		}
	}
}

func (f *fileMap) SyncKeys(keys []Key) error {
	if f.jrn == nil {
		return f.Sync()
	}
	var (
		rk   rawKey
		need uint64
	)
	f.mu.RLock()
	closed := f.closed
	for _, k := range keys {
		if k.put(&rk) == nil {
			need = max(need, f.pending[rk])
		}
	}
	f.mu.RUnlock()
	if closed {
		return ErrClosed
	}
	if need == 0 || f.jrn.Durable() >= need {
		return nil
	}
	return f.syncJournal(need)
}

func (f *fileMap) Compact() error {
	if f.jrn == nil {
		return f.writeWhole()
	}
	f.syncMu.Lock()
	defer f.syncMu.Unlock()
	f.mu.RLock()
	dirty := f.dirty
	f.mu.RUnlock()
	if !dirty {
		// The file holds every entry: nothing to compact.
		return nil
	}
	err := f.jrn.Compact(func(flush func(uint64, journal.Base)) (uint64, journal.Base, error) {
		// Encoding and the journal's count under one lock: every record
		// up to upTo is in the bytes written.
		f.mu.Lock()
		f.buf = encodeFile(f.buf, f.entries)
		upTo := f.jrn.Appended()
		f.dirty = false
		f.mu.Unlock()
		// The journal then holds exactly the records the file does.
		flush(upTo, journal.BaseOf(f.buf))
		if err := writeFileAtomic(f.path, f.buf, f.fault); err != nil {
			f.mu.Lock()
			f.dirty = true
			f.mu.Unlock()
			return 0, journal.Base{}, err
		}
		// The journal's header names the file just written.
		return upTo, journal.BaseOf(f.buf), nil
	})
	f.forgetDurable()
	if err != nil && !errors.Is(err, journal.ErrClosed) {
		return err
	}
	return nil
}

// JournalSize returns the bytes of the file backend's journal, 0 without
// one; the ipcache compacts a journal grown large.
func JournalSize(m Map) int64 {
	if f, ok := m.(*fileMap); ok && f.jrn != nil {
		return f.jrn.Size()
	}
	return 0
}

// FileSize returns the bytes of the file backend's last snapshot file
// written or read, 0 for bpf.
func FileSize(m Map) int64 {
	if f, ok := m.(*fileMap); ok {
		f.mu.RLock()
		defer f.mu.RUnlock()
		return int64(headerSize + len(f.entries)*recordSize)
	}
	return 0
}
