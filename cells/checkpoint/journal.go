package checkpoint

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/durability"
	"github.com/identityd/identityd/internal/journal"
	"github.com/identityd/identityd/labels"
)

// JournalFileName is the journal of local identity changes in the state
// directory, beside the checkpoint. Only identityd reads and writes it; a
// Cilium agent restoring from the checkpoint alone misses at most the
// changes since the last checkpoint write, as after its own crashes.
const JournalFileName = "local_identities.journal"

// journalKind tells the journal's records apart from the ipcache's.
const journalKind = 1

// Record types of the journal.
const (
	recUpsert byte = 1 // id, canonical label string
	recDelete byte = 2 // id
)

// journalSizeFactor and minCompactSize bound the journal: once it is
// larger than both minCompactSize and journalSizeFactor times the last
// checkpoint, a checkpoint is written without waiting for the interval,
// so the disk it takes stays in proportion to the state while the cost of
// the rewrite stays spread over the records that made it grow.
const (
	journalSizeFactor = 4
	minCompactSize    = 16 << 20
)

// maxPendingBytes is how much of records not waited for may pile up in
// memory before they are written anyway.
const maxPendingBytes = 1 << 20

// jentry is what the checkpoint and the journal's records, replayed in
// order, give an ID: its label set and the record that gave it (0 when the
// checkpoint file holds it).
type jentry struct {
	labels labels.Labels
	seq    uint64
}

// jrec is a change recorded while a checkpoint is being written, to
// rebuild the replayed state once it is on disk.
type jrec struct {
	id     identity.NumericIdentity
	labels labels.Labels // nil: deleted
	seq    uint64
}

func encodeRecord(dst []byte, ch allocator.Change) []byte {
	if ch.Kind == allocator.ChangeDelete {
		dst = append(dst, recDelete)
		return binary.LittleEndian.AppendUint32(dst, uint32(ch.ID))
	}
	dst = append(dst, recUpsert)
	dst = binary.LittleEndian.AppendUint32(dst, uint32(ch.ID))
	return append(dst, ch.Labels.CanonicalBytes()...)
}

// decodeRecord parses one record; a record that does not describe a valid
// local identity is an error.
func decodeRecord(p []byte) (identity.NumericIdentity, labels.Labels, bool, error) {
	if len(p) < 5 {
		return 0, nil, false, fmt.Errorf("record of %d bytes", len(p))
	}
	id := identity.NumericIdentity(binary.LittleEndian.Uint32(p[1:]))
	if !id.HasLocalScope() || id.Validate() != nil {
		return 0, nil, false, fmt.Errorf("record of identity %d, not a local one", id)
	}
	switch p[0] {
	case recDelete:
		if len(p) != 5 {
			return 0, nil, false, fmt.Errorf("delete record of %d bytes", len(p))
		}
		return id, nil, true, nil
	case recUpsert:
		lbls, err := labels.ParseCanonical(string(p[5:]))
		if err != nil {
			return 0, nil, false, fmt.Errorf("record of identity %d: %w", id, err)
		}
		if len(lbls) == 0 {
			return 0, nil, false, fmt.Errorf("record of identity %d without labels", id)
		}
		return id, lbls, false, nil
	default:
		return 0, nil, false, fmt.Errorf("record of unknown type %d", p[0])
	}
}

// replay applies the journal's records to the checkpoint's identities and
// returns the result in the checkpoint's order, the new ones after. Records
// that do not parse are skipped and counted.
func replay(ids []identity.Identity, records [][]byte) ([]identity.Identity, map[identity.NumericIdentity]jentry, int) {
	state := make(map[identity.NumericIdentity]jentry, len(ids))
	order := make([]identity.NumericIdentity, 0, len(ids))
	for _, id := range ids {
		if _, dup := state[id.ID]; !dup {
			order = append(order, id.ID)
		}
		state[id.ID] = jentry{labels: id.Labels}
	}
	invalid := 0
	for _, r := range records {
		id, lbls, del, err := decodeRecord(r)
		if err != nil {
			invalid++
			continue
		}
		if del {
			delete(state, id)
			continue
		}
		if _, known := state[id]; !known {
			order = append(order, id)
		}
		state[id] = jentry{labels: lbls}
	}
	out := make([]identity.Identity, 0, len(state))
	for _, id := range order {
		if e, ok := state[id]; ok {
			out = append(out, identity.Identity{ID: id, Labels: e.labels})
			// Appended again later, after a delete: once is enough.
			delete(state, id)
		}
	}
	for _, id := range out {
		state[id.ID] = jentry{labels: id.Labels}
	}
	return out, state, invalid
}

// JournalReport describes the journal read at restoration.
type JournalReport struct {
	// Path is the journal's file.
	Path string
	// Found is false when there was no journal.
	Found bool
	// Records is the number of valid records replayed over the checkpoint,
	// those salvaged after damage included.
	Records int
	// Salvaged is the number of those found after damage, LostBytes the
	// number of damaged bytes in no record.
	Salvaged  int
	LostBytes int64
	// Covered is the number of records of a journal over the previous
	// checkpoint that the checkpoint read holds already: the trace of a
	// crash between a checkpoint write and the journal's reset, no
	// damage.
	Covered int
	// Invalid counts records with a valid checksum that describe no local
	// identity (skipped).
	Invalid int
	// Damage is why the journal was not read as a whole continuation of
	// the checkpoint (a torn or corrupt record, a damaged header, an empty
	// file, a newer format, another checkpoint than the one loaded), or
	// nil.
	Damage error
	// KeptAs is where a copy of a damaged journal was kept.
	KeptAs string
}

// ErrJournalUnusable is wrapped by Load's error when the journal cannot
// be opened or read (a directory in its place, an immutable file): the
// agent could answer no local identity durably, so restoration refuses
// the start.
var ErrJournalUnusable = errors.New("identity journal unusable")

// loadJournal opens the journal for the loaded checkpoint, replays it over
// res, and keeps the journal open for the changes that follow.
func (c *Checkpoint) loadJournal(res *LoadResult, base journal.Base) error {
	path := c.journalPath()
	j, op, err := journal.Open(path, journalKind, base, time.Now())
	rep := &res.Report.Journal
	rep.Path, rep.Found, rep.Damage, rep.KeptAs = path, op.Found, op.Damage, op.KeptAs
	rep.Salvaged, rep.LostBytes, rep.Covered = op.Salvaged, op.Lost, op.Covered
	if err != nil {
		return fmt.Errorf("%w: %s: %w", ErrJournalUnusable, path, err)
	}
	switch {
	case errors.Is(op.Damage, journal.ErrOtherSnapshot):
		c.log.Warn("Identity journal follows another checkpoint than the one loaded (the checkpoint was replaced, lost or damaged): "+
			"replaying its records over the checkpoint found, what changed between the two is unknown and its numbers withheld; a copy of the file is kept",
			"file", path, "checkpoint", c.path, "kept-as", op.KeptAs, "records", len(op.Records), "reason", op.Damage)
	case errors.Is(op.Damage, journal.ErrEmpty):
		c.log.Error("Identity journal is empty: the changes since the last checkpoint write are unknown, the numbers the state files and the datapath map name are withheld",
			"file", path)
	case op.Damage != nil:
		c.log.Warn("Identity journal damaged: replaying its valid records and those found intact after the damage, a copy of the file is kept",
			"file", path, "kept-as", op.KeptAs, "records", len(op.Records), "salvaged", op.Salvaged, "lost-bytes", op.Lost, "reason", op.Damage)
	case op.Covered > 0:
		c.log.Info("Identity journal follows the previous checkpoint, whose successor holds its records: nothing to replay",
			"file", path, "records", op.Covered)
	}
	ids, state, invalid := replay(res.Identities, op.Records)
	rep.Records, rep.Invalid = len(op.Records), invalid
	if invalid > 0 {
		c.log.Warn("Identity journal records skipped", "file", path, "invalid", invalid)
	}
	res.Seen = appendSeen(res.Seen, res.Identities, op.Records)
	res.Identities = ids
	res.Report.Valid = len(ids)
	if len(op.Records) > 0 {
		c.log.Info("Replayed the identity journal over the checkpoint", "file", path, "records", len(op.Records), "identities", len(ids))
	}
	c.setJournal(j, state)
	return nil
}

// appendSeen adds to seen the local numbers of ids and of the records.
func appendSeen(seen []identity.NumericIdentity, ids []identity.Identity, records [][]byte) []identity.NumericIdentity {
	for _, id := range ids {
		if id.ID.HasLocalScope() {
			seen = append(seen, id.ID)
		}
	}
	for _, r := range records {
		if id, _, _, err := decodeRecord(r); err == nil {
			seen = append(seen, id)
		}
	}
	return seen
}

// maxCopiesRead and maxCopyBytes bound the set-aside copies whose numbers
// Load reads, newest first, so that copies piling up over the years do
// not slow a start.
const (
	maxCopiesRead = 64
	maxCopyBytes  = 2 * MaxFileSize
)

// seenInCopies returns the local numbers named by the copies of the
// checkpoint and of the journal kept aside in dir (by this or an earlier
// start: .corrupt-, .invalid-, .unrestored-), whatever of them still
// decodes: an answered number may be nowhere else once a file was
// damaged, and restoration withholds it for its grace period.
func seenInCopies(dir string) (seen []identity.NumericIdentity, files int) {
	var paths []string
	for _, pattern := range []string{FileName + ".*-*", JournalFileName + ".*-*"} {
		m, _ := filepath.Glob(filepath.Join(dir, pattern))
		paths = append(paths, m...)
	}
	// Newest first: the names end in the Unix time they were kept.
	slices.SortFunc(paths, func(a, b string) int { return strings.Compare(copyTime(b), copyTime(a)) })
	budget := int64(maxCopyBytes)
	for _, p := range paths[:min(len(paths), maxCopiesRead)] {
		data, _, err := readBounded(p, min(MaxFileSize, budget))
		if err != nil || len(data) == 0 {
			continue
		}
		budget -= int64(len(data))
		files++
		if strings.HasPrefix(filepath.Base(p), JournalFileName) {
			jc := journal.Decode(data, journalKind)
			seen = appendSeen(seen, nil, append(slices.Clip(jc.Records), jc.Salvaged...))
			continue
		}
		ids, _, err := Decode(data)
		if err == nil {
			seen = appendSeen(seen, ids, nil)
		}
	}
	return seen, files
}

// copyTime is the Unix time in a kept copy's name, zero-padded so that
// names compare by time.
func copyTime(path string) string {
	s := path[strings.LastIndexByte(path, '-')+1:]
	if _, err := strconv.ParseUint(s, 10, 64); err != nil {
		// A -n suffix of a second copy in the same second.
		rest := strings.TrimSuffix(path, "-"+s)
		s = rest[strings.LastIndexByte(rest, '-')+1:]
	}
	return fmt.Sprintf("%020s", s)
}

func (c *Checkpoint) journalPath() string {
	return filepath.Join(filepath.Dir(c.path), JournalFileName)
}

// setJournal makes j the open journal with the replayed state, and records
// the changes observed before it was open.
func (c *Checkpoint) setJournal(j *journal.Journal, state map[identity.NumericIdentity]jentry) {
	j.Fault = c.journalFault
	c.jmu.Lock()
	defer c.jmu.Unlock()
	c.jrn = j
	c.journaled = state
	c.notifyLocked()
	early := c.early
	c.early = nil
	for _, ch := range early {
		c.recordLocked(ch)
	}
}

// notifyLocked wakes every waitRecorded; jmu held. Every change of
// journaled and of stopped must call it, whatever made the change: a
// waiter that found its identity missing sleeps until the next call, and
// nothing else wakes it. (A checkpoint write that takes the identity into
// the file, for one, leaves the allocator's later event for it nothing to
// record.)
func (c *Checkpoint) notifyLocked() {
	close(c.jwake)
	c.jwake = make(chan struct{})
}

// journalFault is the journal's fault hook, for tests of a stalled disk.
func (c *Checkpoint) journalFault(step string) error {
	if f := c.jfault.Load(); f != nil {
		return (*f)(step)
	}
	return nil
}

// openJournal opens the journal in a hive whose restoration never loaded
// the checkpoint: the journal's old records are not part of the state
// this agent writes, so they are kept aside and the journal started afresh.
func (c *Checkpoint) openJournal() (*journal.Journal, error) {
	c.jmu.Lock()
	j, loaded := c.jrn, c.loaded
	c.jmu.Unlock()
	if j != nil || loaded {
		return j, nil
	}
	c.jopen.Lock()
	defer c.jopen.Unlock()
	c.jmu.Lock()
	j = c.jrn
	c.jmu.Unlock()
	if j != nil {
		return j, nil
	}
	// The journal goes on over the checkpoint file as it is: this agent
	// writes it only after it has opened the journal.
	data, _, rerr := readBounded(c.path, MaxFileSize)
	if rerr != nil && !errors.Is(rerr, fs.ErrNotExist) {
		data = nil
	}
	base := journal.BaseOf(data)
	path := c.journalPath()
	j, op, err := journal.Open(path, journalKind, base, time.Now())
	if err != nil {
		return nil, err
	}
	if op.Damage != nil {
		c.log.Warn("Identity journal damaged or of another checkpoint, a copy is kept", "file", path, "kept-as", op.KeptAs, "reason", op.Damage)
	}
	if len(op.Records) > 0 {
		kept, err := keepJournalAside(path)
		if err != nil {
			j.Close()
			return nil, fmt.Errorf("identity journal %s was not restored and cannot be kept aside: %w", path, err)
		}
		if err := j.Compact(func(func(uint64, journal.Base)) (uint64, journal.Base, error) { return 0, base, nil }); err != nil {
			j.Close()
			return nil, err
		}
		c.log.Warn("Identity journal not restored (no restoration in this agent), a copy is kept", "file", path, "kept-as", kept)
	}
	c.setJournal(j, map[identity.NumericIdentity]jentry{})
	return j, nil
}

// journalIfRestored returns the open journal, opening it if restoration
// has finished without loading the checkpoint; nil while restoration has
// not finished: its Load opens the journal.
func (c *Checkpoint) journalIfRestored() (*journal.Journal, error) {
	done, cancel := context.WithCancel(context.Background())
	cancel()
	if c.alloc.WaitForRestoration(done) != nil {
		return nil, nil
	}
	return c.openJournal()
}

func keepJournalAside(path string) (string, error) {
	var rep Report
	err := Loader{}.setAside(path, "unrestored", errors.New("not restored"), &rep, copyFile)
	return rep.SetAside, err
}

// record appends a local identity change to the journal, unless the
// replayed state already says so. Changes observed before the journal is
// open wait for it.
func (c *Checkpoint) record(ch allocator.Change) {
	c.jmu.Lock()
	defer c.jmu.Unlock()
	if c.jrn == nil {
		if !c.loaded {
			c.early = append(c.early, ch)
		}
		// Loaded without a journal: the load failed, writes are
		// disabled and nothing is recorded.
		return
	}
	c.recordLocked(ch)
}

func (c *Checkpoint) recordLocked(ch allocator.Change) {
	cur, known := c.journaled[ch.ID]
	var r jrec
	switch {
	case ch.Kind == allocator.ChangeDelete:
		if !known {
			return
		}
		c.jbuf = encodeRecord(c.jbuf[:0], ch)
		r = jrec{id: ch.ID, seq: c.jrn.Append(c.jbuf)}
		delete(c.journaled, ch.ID)
	case known && cur.labels.Equal(ch.Labels):
		return
	default:
		c.jbuf = encodeRecord(c.jbuf[:0], ch)
		r = jrec{id: ch.ID, labels: ch.Labels, seq: c.jrn.Append(c.jbuf)}
		c.journaled[ch.ID] = jentry{labels: ch.Labels, seq: r.seq}
	}
	if c.capturing {
		c.since = append(c.since, r)
	}
	c.notifyLocked()
}

// observerStopped tells SyncIdentities that no more changes will be
// recorded: it then waits for a whole write instead.
func (c *Checkpoint) observerStopped() {
	c.jmu.Lock()
	defer c.jmu.Unlock()
	c.stopped = true
	c.notifyLocked()
}

// SyncIdentities returns once the given local identities survive a crash
// of the agent: a record of each is in the journal on disk, or in the
// checkpoint file. It is the durability point of identity/allocate and
// the ipcache's WaitDurable (allocator.IdentitySyncer), and costs one
// journal write shared by every caller waiting at that moment, whatever
// the number of identities the node holds; an identity already durable
// (a label set the node already held) costs no write at all. Identities
// of other scopes are ignored, and so is one released meanwhile (the
// journal then holds its release).
//
// Like Sync it waits for restoration, and fails with ctx's error when ctx
// ends first, even while a write hangs on a stalled disk.
func (c *Checkpoint) SyncIdentities(ctx context.Context, ids ...*identity.Identity) error {
	if err := c.alloc.WaitForRestoration(ctx); err != nil {
		return fmt.Errorf("checkpoint sync: %w", err)
	}
	// A checkpoint write holds mu for as long as it writes the whole
	// file, and an answer that is durable already must not wait for it.
	// That write found nothing forbidding it (it checks blocked first),
	// and only Load, which restoration ran before, sets blocked: a held
	// mu means writing is allowed. (Should it be forbidden after all, the
	// journal is not open and Sync below says why.)
	if c.mu.TryLock() {
		blocked := c.blocked
		c.mu.Unlock()
		if blocked != nil {
			return fmt.Errorf("checkpoint sync: %w", blocked)
		}
	}
	j, err := c.openJournal()
	if err != nil || j == nil {
		c.log.Warn("Identity journal unavailable, writing the whole checkpoint", "error", err)
		return c.Sync(ctx)
	}
	var need uint64
	for _, id := range ids {
		if id == nil || !id.ID.HasLocalScope() {
			continue
		}
		seq, whole, err := c.waitRecorded(ctx, id)
		if err != nil {
			return err
		}
		if whole {
			return c.Sync(ctx)
		}
		need = max(need, seq)
	}
	if j.Durable() >= need {
		return nil
	}
	err = durability.Wait(ctx, func() error { return j.Sync(need) })
	if errors.Is(err, journal.ErrBroken) {
		// Not emptied after the last checkpoint write, the journal
		// takes no record until the next write empties it: this one.
		c.log.Warn("Identity journal unusable, writing the whole checkpoint", "error", err)
		return c.Sync(ctx)
	}
	if errors.Is(err, durability.ErrWriteNotEnded) {
		return fmt.Errorf("checkpoint sync: the identity journal: %w", err)
	}
	if err != nil {
		return fmt.Errorf("checkpoint sync: %w", err)
	}
	return nil
}

// waitRecorded waits until the journal's state gives id its labels and
// returns the record that did (0: in the checkpoint file). The allocator
// tells its changes to observers a moment after the allocation returns;
// an identity released meanwhile needs no record of its own. whole is
// true when changes are no longer observed (the agent stops): only a
// whole write can then make the identity durable.
func (c *Checkpoint) waitRecorded(ctx context.Context, id *identity.Identity) (seq uint64, whole bool, err error) {
	for {
		c.jmu.Lock()
		e, ok := c.journaled[id.ID]
		wake, stopped := c.jwake, c.stopped
		c.jmu.Unlock()
		if ok && e.labels.Equal(id.Labels) {
			return e.seq, false, nil
		}
		if cur := c.alloc.LookupByID(id.ID); cur == nil || !cur.Labels.Equal(id.Labels) {
			return 0, false, nil
		}
		if stopped {
			return 0, true, nil
		}
		select {
		case <-wake:
		case <-ctx.Done():
			return 0, false, fmt.Errorf("checkpoint sync: identity %d not recorded: %w", id.ID, ctx.Err())
		}
	}
}

// beginCapture is called by a write right before it takes the allocator's
// identities: the records numbered up to the returned one are in the
// snapshot it takes, and the changes recorded from now on are kept to
// rebuild the replayed state once the snapshot is on disk.
func (c *Checkpoint) beginCapture(j *journal.Journal) uint64 {
	c.jmu.Lock()
	defer c.jmu.Unlock()
	c.capturing = true
	c.since = c.since[:0]
	return j.Appended()
}

// endCapture replaces the replayed state by what replaying the journal
// over the new checkpoint gives: its identities, then the records that
// came after its capture. Without it, a change equal to what the old
// state held would go unrecorded while the new checkpoint lacks it.
func (c *Checkpoint) endCapture(ids []*identity.Identity, written bool) {
	var state map[identity.NumericIdentity]jentry
	if written {
		state = make(map[identity.NumericIdentity]jentry, len(ids))
		for _, id := range ids {
			if id != nil {
				state[id.ID] = jentry{labels: id.Labels}
			}
		}
	}
	c.jmu.Lock()
	defer c.jmu.Unlock()
	if written {
		for _, r := range c.since {
			if r.labels == nil {
				delete(state, r.id)
			} else {
				state[r.id] = jentry{labels: r.labels, seq: r.seq}
			}
		}
		c.journaled = state
		// The file now holds identities whose records may not have
		// come yet, and will add nothing when they do.
		c.notifyLocked()
	}
	c.capturing = false
	c.since = c.since[:0]
}

// journalOversized tells whether the journal should be compacted without
// waiting for the interval.
func (c *Checkpoint) journalOversized() bool {
	c.jmu.Lock()
	j := c.jrn
	c.jmu.Unlock()
	if j == nil {
		return false
	}
	c.mu.Lock()
	snap := c.status.Size
	c.mu.Unlock()
	size := j.Size()
	return size > minCompactSize && size > journalSizeFactor*snap
}

// flushIfPiledUp writes the records nobody waited for once they take
// maxPendingBytes of memory.
func (c *Checkpoint) flushIfPiledUp() {
	c.jmu.Lock()
	j := c.jrn
	c.jmu.Unlock()
	if j == nil {
		return
	}
	if _, b := j.Pending(); b >= maxPendingBytes {
		if err := j.Sync(j.Appended()); err != nil {
			c.log.Warn("Identity journal write failed", "file", j.Path(), "error", err)
		}
	}
}

// closeJournal closes the journal after the final write. If that write
// failed, the records not yet on disk are written first, so the journal
// keeps what the checkpoint could not.
func (c *Checkpoint) closeJournal(finalErr error) {
	c.jmu.Lock()
	j := c.jrn
	c.jmu.Unlock()
	if j == nil {
		return
	}
	if finalErr != nil {
		if err := j.Sync(j.Appended()); err != nil {
			c.log.Error("Identity journal write failed at stop", "file", j.Path(), "error", err)
		}
	}
	if err := j.Close(); err != nil && !errors.Is(err, os.ErrClosed) {
		c.log.Warn("Identity journal close failed", "file", j.Path(), "error", err)
	}
}

// journalRecords reads the records a restart would replay from the
// journal on disk, without changing it, for checkpoint/show.
func (c *Checkpoint) journalRecords(base journal.Base) [][]byte {
	data, _, err := readBounded(c.journalPath(), MaxFileSize)
	if err != nil {
		return nil
	}
	records, _ := toReplay(data, base)
	return records
}

// toReplay returns the records of a journal's bytes that a restart over
// the snapshot base replays, as journal.Open chooses them, and the damage
// it reports: the valid ones and those salvaged after damage; none when
// the journal ends with a successor record naming base (the snapshot holds
// them all).
func toReplay(data []byte, base journal.Base) ([][]byte, journal.Contents) {
	c := journal.Decode(data, journalKind)
	records := append(slices.Clip(c.Records), c.Salvaged...)
	switch {
	case len(data) == 0:
		c.Damage = journal.ErrEmpty
	case c.Valid < journal.HeaderSize || c.Base == base:
	case c.Damage == nil && c.Successor != nil && *c.Successor == base:
		records = nil
	case len(records) > 0:
		c.Damage = fmt.Errorf("%w: it follows a snapshot of %v, the file has %v", journal.ErrOtherSnapshot, c.Base, base)
	}
	return records, c
}

// LoadJournaled is Load followed by a replay of the journal beside path
// (JournalFileName in its directory), which it reads without changing: the
// identities a restart would restore, for tools and tests: the records
// after a damaged one that still verify are replayed too, and so is a
// journal that follows another snapshot than the file, unless the file
// holds its records already, as at restoration.
func (l Loader) LoadJournaled(path string) (LoadResult, error) {
	res, base, err := l.loadBase(path)
	if err != nil {
		return res, err
	}
	jpath := filepath.Join(filepath.Dir(path), JournalFileName)
	data, _, rerr := readBounded(jpath, MaxFileSize)
	if rerr != nil {
		return res, nil
	}
	records, c := toReplay(data, base)
	rep := &res.Report.Journal
	rep.Path, rep.Found, rep.Damage, rep.Records = jpath, true, c.Damage, len(records)
	rep.Salvaged, rep.LostBytes = len(c.Salvaged), c.Lost
	res.Identities, _, rep.Invalid = replay(res.Identities, records)
	res.Report.Valid = len(res.Identities)
	return res, nil
}
