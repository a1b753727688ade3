// Package journal is the append-only log that makes one durable answer cost
// one small write instead of a rewrite of the whole state: the checkpoint
// and the ipcache map file are snapshots, and every change since the last
// snapshot is a record here. Restart reads the snapshot and replays the
// journal's valid prefix.
//
// # Format
//
// A journal file starts with a 32-byte header: the magic "idjournl", the
// format version (uint32, little endian, Version), the kind (uint32,
// little endian), which names what the records describe so that one
// journal is never replayed as another's, the Base of the snapshot the
// records follow (its size, uint64, and CRC-32C, uint32) and the CRC-32C
// of the 28 bytes before it. Records follow, each framed as
//
//	length  uint32 LE   bytes of payload, 1..MaxRecord
//	crc     uint32 LE   CRC-32C (Castagnoli) of the length field and the payload
//	payload length bytes
//
// The checksum covers the length too, so a torn or zeroed length is found
// as surely as a damaged payload. A reader stops at the first record that
// is short, too long or fails its checksum: everything before it is the
// valid prefix. It then searches the bytes after it for records that
// still verify by their own checksum (a flipped byte, a cut or an
// overwritten range leaves the records after it intact): each was a
// durable state of what it describes when it was written, so they are
// replayed after the prefix, in file order. A damaged header gets the
// same search from the first record on.
//
// A journal is replayed over the snapshot its header names. When the
// snapshot read is another one, either the crash came between a
// snapshot's write and the journal's reset, and the snapshot holds every
// record already (Compact's successor record names it), or the snapshot's file was
// replaced (a backup restored, another agent's file) or lost: the records
// are still the last durable states of what they describe, and are
// replayed over the snapshot found, the journal reported as damaged.
//
// A journal file is created holding its header and never cut below it,
// so an empty file is damage too: whatever it held is unknown.
//
// # Writing
//
// Append buffers a record in memory and returns its sequence number; Sync
// makes every record up to a number durable with one write and one fsync
// for all the records waiting at that moment (group commit): callers that
// come while a write runs share the next one. Compact writes a snapshot
// through its caller and then empties the file, keeping the records
// appended after the snapshot was taken.
package journal

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"io/fs"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/identityd/identityd/internal/atomicfile"
)

// Version is the format version this package writes and reads. Version 1
// had a 16-byte header that named no snapshot: such a journal with records
// is kept aside, a bare header is started afresh.
const Version = 2

// HeaderSize is the size of the file header; RecordOverhead the bytes
// each record adds to its payload.
const (
	HeaderSize     = 32
	RecordOverhead = 8
)

// v1HeaderSize is the header of format version 1.
const v1HeaderSize = 16

// Base names the snapshot a journal follows by the size and the CRC-32C
// of its file's bytes. The zero Base is no snapshot file (an empty file
// has the same).
type Base struct {
	Size uint64
	CRC  uint32
}

// BaseOf returns the Base of a snapshot file holding data.
func BaseOf(data []byte) Base {
	return Base{Size: uint64(len(data)), CRC: crc32.Checksum(data, castagnoli)}
}

func (b Base) String() string {
	return fmt.Sprintf("%d bytes, crc32c %08x", b.Size, b.CRC)
}

// MaxRecord bounds a record's payload: a length above it is damage, not a
// record to allocate memory for.
const MaxRecord = 1 << 20

var magic = [8]byte{'i', 'd', 'j', 'o', 'u', 'r', 'n', 'l'}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Errors that describe a damaged journal. Read's Damage wraps one of them.
var (
	// ErrTorn: the file ends inside a record (a write cut short by a
	// crash), or inside the header.
	ErrTorn = errors.New("torn record at the end")
	// ErrChecksum: a record's checksum does not match its bytes.
	ErrChecksum = errors.New("record checksum mismatch")
	// ErrBadLength: a record's length is 0 or above MaxRecord.
	ErrBadLength = errors.New("record length out of bounds")
	// ErrNotJournal: the file does not start with the journal magic.
	ErrNotJournal = errors.New("not a journal")
	// ErrNewerVersion: the file was written by a newer format version,
	// whose records this one cannot read.
	ErrNewerVersion = errors.New("journal of a newer format version")
	// ErrOtherKind: the journal holds records of another kind.
	ErrOtherKind = errors.New("journal of another kind")
	// ErrOtherSnapshot: the journal follows another snapshot than the
	// one read (the snapshot's file was replaced), or names none.
	ErrOtherSnapshot = errors.New("journal of another snapshot")
	// ErrEmpty: the file is empty. A journal is created with its
	// header and never cut below it, so something else emptied it:
	// whatever its records held is unknown.
	ErrEmpty = errors.New("zero-length journal (a journal always holds its header)")
	// ErrBroken: the journal cannot take records until the next
	// snapshot (Compact): a failed write could not be undone, or the
	// journal could not be emptied after a snapshot. The caller makes
	// its changes durable with a snapshot instead.
	ErrBroken = errors.New("journal unusable until the next snapshot")
)

// successorTag starts the payload of a successor record, which Compact
// writes right before its snapshot and which names that snapshot. Its
// first byte is zero, which no caller's payload may start with.
var successorTag = [4]byte{0, 's', 'n', 'p'}

// successorSize is the payload size of a successor record: the tag, the
// snapshot's size and CRC-32C.
const successorSize = 4 + 8 + 4

func successorPayload(b Base) []byte {
	p := make([]byte, successorSize)
	copy(p, successorTag[:])
	binary.LittleEndian.PutUint64(p[4:], b.Size)
	binary.LittleEndian.PutUint32(p[12:], b.CRC)
	return p
}

// successorOf returns the snapshot a successor record names.
func successorOf(p []byte) (Base, bool) {
	if len(p) != successorSize || string(p[:4]) != string(successorTag[:]) {
		return Base{}, false
	}
	return Base{Size: binary.LittleEndian.Uint64(p[4:]), CRC: binary.LittleEndian.Uint32(p[12:])}, true
}

// Header returns the header of a journal of kind that follows base.
func Header(kind uint32, base Base) []byte {
	h := make([]byte, HeaderSize)
	copy(h, magic[:])
	binary.LittleEndian.PutUint32(h[8:], Version)
	binary.LittleEndian.PutUint32(h[12:], kind)
	binary.LittleEndian.PutUint64(h[16:], base.Size)
	binary.LittleEndian.PutUint32(h[24:], base.CRC)
	binary.LittleEndian.PutUint32(h[28:], crc32.Checksum(h[:28], castagnoli))
	return h
}

// AppendRecord appends the framing and payload of one record to dst.
func AppendRecord(dst, payload []byte) []byte {
	var hdr [RecordOverhead]byte
	binary.LittleEndian.PutUint32(hdr[0:], uint32(len(payload)))
	crc := crc32.Update(0, castagnoli, hdr[0:4])
	crc = crc32.Update(crc, castagnoli, payload)
	binary.LittleEndian.PutUint32(hdr[4:], crc)
	dst = append(dst, hdr[:]...)
	return append(dst, payload...)
}

// Contents is what Decode found in a journal's bytes.
type Contents struct {
	// Records are the payloads of the valid prefix, in order; they alias
	// the decoded bytes.
	Records [][]byte
	// Valid is the length of the valid prefix in bytes, header included
	// (0 when the header itself is bad; 16 for the bare header of format
	// version 1, which holds nothing).
	Valid int64
	// Damage is why decoding stopped before the end, or nil when every
	// byte was read. It wraps one of the Err* values.
	Damage error
	// Base is the snapshot the header names (when Valid > 0).
	Base Base
	// Salvaged are the records after the damage that still verify by
	// their own checksum, in file order; Lost is the number of bytes
	// after the valid prefix in none of them.
	Salvaged [][]byte
	Lost     int64
	// HeaderDamaged says the header failed its checksum: the records
	// were all salvaged, and the snapshot they follow is unknown.
	HeaderDamaged bool
	// Successor is the snapshot a successor record names when that
	// record ends the file: the snapshot written after the records,
	// which holds every one of them.
	Successor *Base
}

// Decode reads a journal of kind from data. It never panics: whatever the
// bytes, it returns the records of the valid prefix, says why it stopped,
// and salvages the records after the damage that still verify by their own
// checksum (see salvage). An empty input holds nothing and has no damage;
// Open, which knows that a journal file always holds its header, tells the
// empty file apart.
func Decode(data []byte, kind uint32) Contents {
	var c Contents
	if len(data) == 0 {
		return c
	}
	if len(data) >= HeaderSize && string(data[:len(magic)]) == string(magic[:]) {
		sum := binary.LittleEndian.Uint32(data[28:])
		v := binary.LittleEndian.Uint32(data[8:])
		switch {
		case crc32.Checksum(data[:28], castagnoli) == sum:
			// A sound header: its version and kind are what they say.
			switch k := binary.LittleEndian.Uint32(data[12:]); {
			case v > Version:
				c.Damage = fmt.Errorf("%w: version %d, this agent reads %d", ErrNewerVersion, v, Version)
				return c
			case v != Version && v != 1:
				c.Damage = fmt.Errorf("%w: unknown version %d", ErrNotJournal, v)
				return c
			case v == Version && k != kind:
				c.Damage = fmt.Errorf("%w: kind %d, want %d", ErrOtherKind, k, kind)
				return c
			case v == Version:
				return decodeRecords(data, c, binary.LittleEndian.Uint64(data[16:]), binary.LittleEndian.Uint32(data[24:]))
			}
		case v > Version && !headerOfVersion(data, Version):
			// A newer format may lay its header out otherwise; a damaged
			// version field of this format's header is told apart by
			// the checksum it still matches with this version.
			c.Damage = fmt.Errorf("%w: version %d, this agent reads %d", ErrNewerVersion, v, Version)
			return c
		}
	}
	if len(data) >= 12 && string(data[:len(magic)]) == string(magic[:]) && binary.LittleEndian.Uint32(data[8:]) == 1 {
		return decodeV1(data, kind)
	}
	switch {
	case len(data) < HeaderSize && string(data[:min(len(data), len(magic))]) == string(magic[:min(len(data), len(magic))]):
		c.Damage = fmt.Errorf("%w: %d of %d header bytes", ErrTorn, len(data), HeaderSize)
		return c
	case len(data) < HeaderSize:
		c.Damage = ErrNotJournal
		return c
	case string(data[:len(magic)]) != string(magic[:]) && !hasRecordAt(data, HeaderSize):
		// Neither the magic nor a record where the first one would be:
		// another file, whose bytes are not searched for records.
		c.Damage = ErrNotJournal
		return c
	}
	// A damaged header: the records after it are salvaged. The snapshot
	// they follow is unknown.
	c.Damage = fmt.Errorf("%w: header", ErrChecksum)
	c.HeaderDamaged = true
	c.Salvaged, c.Lost = salvage(data, HeaderSize)
	return c
}

// headerOfVersion tells whether the header's checksum matches its first
// 28 bytes with the version field set to v.
func headerOfVersion(data []byte, v uint32) bool {
	var h [28]byte
	copy(h[:], data[:28])
	binary.LittleEndian.PutUint32(h[8:], v)
	return crc32.Checksum(h[:], castagnoli) == binary.LittleEndian.Uint32(data[28:])
}

// decodeV1 reads a journal of format version 1, whose 16-byte header
// names no snapshot: only its bare header, as a clean stop left it, is
// taken (nothing to replay); one with records is of another snapshot.
func decodeV1(data []byte, kind uint32) Contents {
	var c Contents
	switch {
	case len(data) >= v1HeaderSize && binary.LittleEndian.Uint32(data[12:]) != kind:
		c.Damage = fmt.Errorf("%w: kind %d, want %d", ErrOtherKind, binary.LittleEndian.Uint32(data[12:]), kind)
	case len(data) == v1HeaderSize:
		c.Valid = v1HeaderSize
	default:
		c.Damage = fmt.Errorf("%w: format version 1 names no snapshot", ErrOtherSnapshot)
	}
	return c
}

// decodeRecords reads the records after a sound header.
func decodeRecords(data []byte, c Contents, size uint64, crc uint32) Contents {
	c.Base = Base{Size: size, CRC: crc}
	off := HeaderSize
	c.Valid = int64(off)
	for off < len(data) {
		payload, n, err := frameAt(data, off)
		if err != nil {
			c.Damage = err
			c.Salvaged, c.Lost = salvage(data, off)
			return c
		}
		off += n
		c.Valid = int64(off)
		if b, ok := successorOf(payload); ok {
			c.Successor = &b
			continue
		}
		c.Successor = nil
		c.Records = append(c.Records, payload)
	}
	return c
}

// frameAt decodes the record at off, returning its payload and its size
// with the framing, or why it is no record.
func frameAt(data []byte, off int) ([]byte, int, error) {
	rest := data[off:]
	if len(rest) < RecordOverhead {
		return nil, 0, fmt.Errorf("%w: %d bytes at offset %d", ErrTorn, len(rest), off)
	}
	n := binary.LittleEndian.Uint32(rest[0:])
	sum := binary.LittleEndian.Uint32(rest[4:])
	if n == 0 || n > MaxRecord {
		// A zero length with a zero checksum is a zeroed tail (a file
		// system that extended the file but not its data before the
		// crash): torn, not corrupt.
		if n == 0 && sum == 0 && allZero(rest) {
			return nil, 0, fmt.Errorf("%w: %d zero bytes at offset %d", ErrTorn, len(rest), off)
		}
		return nil, 0, fmt.Errorf("%w: %d at offset %d", ErrBadLength, n, off)
	}
	if uint64(len(rest)-RecordOverhead) < uint64(n) {
		return nil, 0, fmt.Errorf("%w: record of %d bytes at offset %d, %d left", ErrTorn, n, off, len(rest)-RecordOverhead)
	}
	payload := rest[RecordOverhead : RecordOverhead+int(n)]
	crc := crc32.Update(0, castagnoli, rest[0:4])
	if crc32.Update(crc, castagnoli, payload) != sum {
		return nil, 0, fmt.Errorf("%w: record at offset %d", ErrChecksum, off)
	}
	return payload, RecordOverhead + int(n), nil
}

func hasRecordAt(data []byte, off int) bool {
	_, _, err := frameAt(data, off)
	return err == nil
}

// salvage finds the records after damage at off that still verify by
// their own checksum, in file order, and counts the bytes in none of
// them. It first tries the end the damaged record's length names (a
// damaged payload leaves the next record where it was), then every
// offset (a cut or overwritten range moves it). A record found by chance
// in damaged bytes would need a matching CRC-32C: one in 2^32. The
// checksums computed are bounded by a multiple of the file's size, so
// that no bytes make the search slow; what it leaves unsearched counts
// as lost.
func salvage(data []byte, off int) (records [][]byte, lost int64) {
	budget := 32*len(data) + MaxRecord
	if len(data)-off >= RecordOverhead && !hasRecordAt(data, off) {
		if n := binary.LittleEndian.Uint32(data[off:]); n > 0 && n <= MaxRecord {
			if next := off + RecordOverhead + int(n); next < len(data) && hasRecordAt(data, next) {
				lost += int64(next - off)
				off = next
			}
		}
	}
	for off < len(data) {
		if len(data)-off < RecordOverhead || budget <= 0 {
			lost += int64(len(data) - off)
			break
		}
		n := binary.LittleEndian.Uint32(data[off:])
		if n > 0 && n <= MaxRecord && len(data)-off-RecordOverhead >= int(n) {
			budget -= int(n)
			if payload, size, err := frameAt(data, off); err == nil {
				if _, ok := successorOf(payload); !ok {
					records = append(records, payload)
				}
				off += size
				continue
			}
		}
		lost++
		off++
	}
	return records, lost
}

func allZero(b []byte) bool {
	for _, x := range b {
		if x != 0 {
			return false
		}
	}
	return true
}

// Opened is what Open found in the file.
type Opened struct {
	// Records are the payloads to replay, in order: the valid prefix,
	// then the salvaged records.
	Records [][]byte
	// Salvaged is the number of Records found after the damage; Lost
	// the number of damaged bytes in no record.
	Salvaged int
	Lost     int64
	// Covered is the number of records of a journal over the previous
	// snapshot that the snapshot read holds already (none replayed).
	Covered int
	// Found is false when there was no file.
	Found bool
	// Size is the file's size as found.
	Size int64
	// Damage is why the file was not read to its end, or nil.
	Damage error
	// KeptAs is where a copy of the damaged file was kept; empty when
	// nothing was damaged.
	KeptAs string
}

// Journal is an open journal file. Append, Sync, Compact and the other
// methods are safe for concurrent use.
type Journal struct {
	path string
	kind uint32
	// base is the snapshot the file's header names; guarded by fmu.
	base Base

	// mu guards the pending records.
	mu sync.Mutex
	// buf holds the framed records that are not written yet: those
	// numbered first .. appended, ends[i] the end of record first+i.
	buf      []byte
	ends     []int
	first    uint64
	appended uint64
	// fmu serializes the file writes; it is taken before mu.
	fmu  sync.Mutex
	f    *os.File
	size int64 // bytes in the file; guarded by fmu
	// broken is set when a failed write could not be undone (the file
	// may hold a partial record) or the file was not emptied after a
	// snapshot (its header names the old one): nothing may be appended
	// until a Compact succeeds.
	broken error

	durable atomic.Uint64
	closed  bool
	// Fault, when not nil, is called before each write and fsync of the
	// file with the step's name ("write", "fsync", "truncate", "header");
	// an error it returns fails the step. For tests of a failing or
	// stalled disk.
	Fault func(step string) error
}

// Open opens the journal at path for kind over the snapshot base (the
// BaseOf the snapshot file's bytes just read, the zero Base when there was
// none) and returns it with the records to replay. A new file is created
// (mode 0600) holding its header, atomically: a journal file always holds
// at least its header, so an empty one is damage (ErrEmpty), not a journal
// that never held anything.
//
// A damaged file (a torn or corrupt record, a damaged header, a file that
// is no journal, one of a newer version or of another kind) is copied
// aside to <path>.corrupt-<unix time> first. Its records to replay are the
// valid prefix and then the records after the damage that still verify
// (Opened.Salvaged): every one of them was a durable state of its keys
// when it was written, and a key's last record is its last durable state.
// The file is then cut to the valid prefix, or, when records were
// salvaged, rewritten to hold exactly the records returned, so that new
// records follow them.
//
// A journal whose header names another snapshot than base is, when it
// ends with a successor record naming base (see Compact), the trace of a
// crash between a snapshot write and the journal's reset: base holds
// every record, and the journal is started afresh over it with nothing to
// replay and no damage (Opened.Covered). Otherwise the snapshot was replaced
// (an older copy, another agent's file) or lost: a copy is kept, Damage
// wraps ErrOtherSnapshot, its records are returned to be replayed over
// the snapshot found and the file rewritten to hold them over base. The
// caller must treat what it restores then as incomplete.
//
// Only an error that leaves the file untouched is returned: the caller
// must then not write it.
func Open(path string, kind uint32, base Base, now time.Time) (*Journal, Opened, error) {
	var op Opened
	f, err := os.OpenFile(path, os.O_RDWR|syscall.O_NONBLOCK, 0)
	created := false
	if errors.Is(err, fs.ErrNotExist) {
		// Created with its header by a rename: no crash leaves an empty
		// journal behind.
		if werr := atomicfile.Write(path, Header(kind, base)); werr != nil {
			return nil, op, fmt.Errorf("create journal: %w", werr)
		}
		created = true
		f, err = os.OpenFile(path, os.O_RDWR|syscall.O_NONBLOCK, 0)
	}
	if err != nil {
		return nil, op, fmt.Errorf("open journal: %w", err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, op, fmt.Errorf("stat journal: %w", err)
	}
	if !fi.Mode().IsRegular() {
		f.Close()
		return nil, op, fmt.Errorf("journal %s is not a regular file (%s)", path, fi.Mode().Type())
	}
	op.Found = !created
	op.Size = fi.Size()
	if fi.Size() > 1<<31 {
		f.Close()
		return nil, op, fmt.Errorf("journal %s is %d bytes, too large to read", path, fi.Size())
	}
	data := make([]byte, fi.Size())
	if _, err := io.ReadFull(f, data); err != nil {
		f.Close()
		return nil, op, fmt.Errorf("read journal: %w", err)
	}
	c := Decode(data, kind)
	if len(data) == 0 {
		c.Damage = ErrEmpty
	}
	records := c.Records
	if len(c.Salvaged) > 0 {
		records = append(slices.Clip(records), c.Salvaged...)
	}
	other := c.Valid >= HeaderSize && c.Base != base
	switch {
	case !other:
	case len(records) == 0 && c.Damage == nil:
		// Nothing to replay: only the header is out of date.
	case c.Damage == nil && c.Successor != nil && *c.Successor == base:
		// The snapshot holds every record: the crash came between its
		// write and the journal's reset.
		op.Covered = len(records)
		records = nil
	case c.Damage == nil:
		c.Damage = fmt.Errorf("%w: it follows a snapshot of %v, the snapshot read has %v", ErrOtherSnapshot, c.Base, base)
	default:
		c.Damage = fmt.Errorf("%w: it follows a snapshot of %v, the snapshot read has %v; and %w", ErrOtherSnapshot, c.Base, base, c.Damage)
	}
	op.Records, op.Damage = records, c.Damage
	op.Salvaged, op.Lost = len(c.Salvaged), c.Lost
	if c.Damage != nil && len(data) > 0 {
		kept, err := keepCopy(path, data, now)
		if err != nil {
			f.Close()
			return nil, op, fmt.Errorf("journal %s is damaged (%v) and cannot be kept aside: %w", path, c.Damage, err)
		}
		op.KeptAs = kept
	}
	j := &Journal{path: path, kind: kind, base: base, f: f, first: 1}
	switch {
	case len(records) > 0 && (other || len(c.Salvaged) > 0 || c.HeaderDamaged):
		// The file is made to hold exactly what is replayed, over base.
		f.Close()
		out := Header(kind, base)
		for _, r := range records {
			out = AppendRecord(out, r)
		}
		if err := atomicfile.Write(path, out); err != nil {
			return nil, op, fmt.Errorf("rewrite journal with its salvaged records: %w", err)
		}
		if j.f, err = os.OpenFile(path, os.O_RDWR|syscall.O_NONBLOCK, 0); err != nil {
			return nil, op, fmt.Errorf("open journal: %w", err)
		}
		j.size = int64(len(out))
	case c.Valid < HeaderSize || other:
		// No valid header, or one naming another snapshot over no
		// record to keep: start afresh.
		if err := j.writeHeader(base); err != nil {
			f.Close()
			return nil, op, err
		}
	case c.Valid < fi.Size():
		if err := f.Truncate(c.Valid); err != nil {
			f.Close()
			return nil, op, fmt.Errorf("cut journal to its valid prefix: %w", err)
		}
		if err := f.Sync(); err != nil {
			f.Close()
			return nil, op, fmt.Errorf("sync journal: %w", err)
		}
		j.size = c.Valid
	default:
		j.size = c.Valid
	}
	return j, op, nil
}

// writeHeader replaces the file's contents, which hold no record to
// keep, by a bare header naming base. The header is written over the
// old bytes before the rest is cut, so that a crash leaves a header, old
// or new, never an empty or torn file.
func (j *Journal) writeHeader(base Base) error {
	if _, err := j.f.WriteAt(Header(j.kind, base), 0); err != nil {
		return fmt.Errorf("write journal header: %w", err)
	}
	if err := j.f.Truncate(HeaderSize); err != nil {
		return fmt.Errorf("truncate journal: %w", err)
	}
	if err := j.f.Sync(); err != nil {
		return fmt.Errorf("sync journal: %w", err)
	}
	j.size = HeaderSize
	j.base = base
	return nil
}

// reset empties the file to a header naming base, the snapshot just
// written; fmu held. The records are cut and synced before the header
// changes: a crash in between leaves the old header with no record, which
// Open starts afresh, never a new header over records of the old
// snapshot.
func (j *Journal) reset(base Base) error {
	if err := j.step("truncate"); err != nil {
		return err
	}
	if err := j.f.Truncate(HeaderSize); err != nil {
		return fmt.Errorf("truncate journal: %w", err)
	}
	if err := j.f.Sync(); err != nil {
		return fmt.Errorf("sync journal: %w", err)
	}
	j.size = HeaderSize
	if base == j.base {
		return nil
	}
	if err := j.step("header"); err != nil {
		return err
	}
	return j.writeHeader(base)
}

func (j *Journal) step(name string) error {
	if j.Fault != nil {
		if err := j.Fault(name); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
	}
	return nil
}

// keepCopy writes data to a new file <path>.corrupt-<unix time>[-n].
func keepCopy(path string, data []byte, now time.Time) (string, error) {
	base := path + ".corrupt-" + strconv.FormatInt(now.Unix(), 10)
	for i := 0; i < 1000; i++ {
		to := base
		if i > 0 {
			to = base + "-" + strconv.Itoa(i)
		}
		f, err := os.OpenFile(to, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if errors.Is(err, fs.ErrExist) {
			continue
		}
		if err != nil {
			return "", err
		}
		if _, err := f.Write(data); err != nil {
			f.Close()
			os.Remove(to)
			return "", err
		}
		if err := f.Sync(); err != nil {
			f.Close()
			os.Remove(to)
			return "", err
		}
		if err := f.Close(); err != nil {
			os.Remove(to)
			return "", err
		}
		return to, nil
	}
	return "", errors.New("no free name")
}

// Path returns the journal's file.
func (j *Journal) Path() string { return j.path }

// Append buffers one record and returns its sequence number (1, 2, …).
// A payload must not start with a zero byte: the journal's own successor
// records do.
// The record is durable once Sync with that number (or a later one)
// returns nil.
func (j *Journal) Append(payload []byte) uint64 {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.buf = AppendRecord(j.buf, payload)
	j.ends = append(j.ends, len(j.buf))
	j.appended++
	return j.appended
}

// Appended returns the number of the last record appended.
func (j *Journal) Appended() uint64 {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.appended
}

// Durable returns the number up to which every record is durable.
func (j *Journal) Durable() uint64 { return j.durable.Load() }

// Pending tells how many records wait for a write and how many bytes they
// take.
func (j *Journal) Pending() (records, bytes int) {
	j.mu.Lock()
	defer j.mu.Unlock()
	return len(j.ends), len(j.buf)
}

// Size returns the bytes in the file, header included.
func (j *Journal) Size() int64 {
	j.fmu.Lock()
	defer j.fmu.Unlock()
	return j.size
}

// ErrClosed is returned by a Sync or Compact after Close.
var ErrClosed = errors.New("journal is closed")

// Sync returns once every record numbered up to seq is on disk. Records
// appended while another Sync writes wait for it and then go out together
// in one write and one fsync: a burst of N callers costs about two writes,
// not N. A failed write is undone (the file is cut back to its last
// record) and its records stay pending for the next Sync.
func (j *Journal) Sync(seq uint64) error {
	if j.durable.Load() >= seq {
		return nil
	}
	j.fmu.Lock()
	defer j.fmu.Unlock()
	if j.durable.Load() >= seq {
		// Written by the Sync this one waited for.
		return nil
	}
	return j.flushLocked()
}

// flushLocked writes every pending record; fmu held.
func (j *Journal) flushLocked() error {
	return j.flushUpToLocked(0, nil)
}

// flushUpToLocked writes the pending records numbered up to seq (every
// one when seq is 0), followed by the framed records of tail, with one
// write and one fsync; fmu held.
func (j *Journal) flushUpToLocked(seq uint64, tail []byte) error {
	if j.closed {
		return ErrClosed
	}
	if j.broken != nil {
		return j.broken
	}
	j.mu.Lock()
	data, upTo, n := j.buf, j.appended, len(j.ends)
	if seq > 0 && seq < upTo {
		upTo = seq
		n = int(max(seq+1, j.first) - j.first)
		if n > 0 {
			data = j.buf[:j.ends[n-1]]
		} else {
			data = nil
		}
	}
	j.mu.Unlock()
	if len(tail) > 0 {
		data = append(slices.Clip(data), tail...)
	}
	if len(data) == 0 {
		j.raiseDurable(upTo)
		return nil
	}
	err := j.step("write")
	if err == nil {
		_, err = j.f.WriteAt(data, j.size)
		if err != nil {
			err = fmt.Errorf("write: %w", err)
		}
	}
	if err == nil {
		if err = j.step("fsync"); err == nil {
			if err = j.f.Sync(); err != nil {
				err = fmt.Errorf("fsync: %w", err)
			}
		}
	}
	if err != nil {
		// Cut back what may have been written, so that the next write
		// follows the last whole record.
		if terr := j.f.Truncate(j.size); terr != nil {
			j.broken = fmt.Errorf("journal %s: %w: a failed write could not be undone: %w", j.path, ErrBroken, terr)
		}
		return fmt.Errorf("journal %s: %w", j.path, err)
	}
	j.size += int64(len(data))
	j.mu.Lock()
	j.dropLocked(n)
	j.mu.Unlock()
	j.raiseDurable(upTo)
	return nil
}

// dropLocked forgets the first n pending records; mu held.
func (j *Journal) dropLocked(n int) {
	if n <= 0 {
		return
	}
	cut := j.ends[n-1]
	rest := len(j.buf) - cut
	if rest == 0 {
		j.buf = j.buf[:0]
		j.ends = j.ends[:0]
	} else {
		// A fresh buffer: the old one may be in a write's hands.
		nb := make([]byte, rest, max(rest, 4096))
		copy(nb, j.buf[cut:])
		j.buf = nb
		ne := make([]int, len(j.ends)-n, cap(j.ends))
		for i, e := range j.ends[n:] {
			ne[i] = e - cut
		}
		j.ends = ne
	}
	j.first += uint64(n)
}

func (j *Journal) raiseDurable(seq uint64) {
	for {
		cur := j.durable.Load()
		if cur >= seq || j.durable.CompareAndSwap(cur, seq) {
			return
		}
	}
}

// Compact replaces the journal by a snapshot. snapshot runs with the
// journal's writes held off; it captures the state, encodes it, calls
// flush with the number of the last record the capture holds (Appended at
// its capture) and the BaseOf the encoded bytes, writes them durably (an
// atomic file write) and returns that number and that Base. flush writes
// the records up to that number that were still pending and then a
// successor record naming the new snapshot: the journal then holds
// exactly the records the snapshot holds, and says so, and a crash before
// it is emptied leaves a journal Open tells from damage. (A failed flush
// is no failure of the snapshot: the records are then in it alone.) When it succeeds, the file is emptied to a header naming that
// base and the pending records up to that number are dropped, as the
// snapshot holds them; the later ones stay pending. When it fails, nothing
// changes. When the journal cannot be emptied, it is broken until a later
// Compact succeeds: its header names the old snapshot, and records
// appended after it would not be replayed over the new one.
func (j *Journal) Compact(snapshot func(flush func(upTo uint64, next Base)) (uint64, Base, error)) error {
	j.fmu.Lock()
	defer j.fmu.Unlock()
	if j.closed {
		return ErrClosed
	}
	upTo, base, err := snapshot(func(upTo uint64, next Base) {
		_ = j.flushUpToLocked(upTo, AppendRecord(nil, successorPayload(next)))
	})
	if err != nil {
		return err
	}
	// The snapshot holds every record up to upTo: those in the file and
	// those pending alike.
	j.mu.Lock()
	if upTo >= j.first {
		j.dropLocked(int(min(upTo, j.appended) - j.first + 1))
	}
	j.mu.Unlock()
	j.raiseDurable(upTo)
	if err := j.reset(base); err != nil {
		// The file names the old snapshot: a restart keeps it aside, and
		// loses nothing, as the new snapshot holds every record in it.
		// But records appended after it would be lost the same way.
		j.broken = fmt.Errorf("journal %s: %w: not emptied after a snapshot: %w", j.path, ErrBroken, err)
		return fmt.Errorf("empty journal %s after snapshot: %w", j.path, err)
	}
	// Whatever a failed write left behind is gone with the rest.
	j.broken = nil
	return nil
}

// Close writes nothing more and closes the file; pending records are
// dropped (a clean stop writes a snapshot first).
func (j *Journal) Close() error {
	j.fmu.Lock()
	defer j.fmu.Unlock()
	if j.closed {
		return nil
	}
	j.closed = true
	return j.f.Close()
}
