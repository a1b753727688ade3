package ipcachemap

import (
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/identityd/identityd/internal/atomicfile"
	"github.com/identityd/identityd/internal/journal"
)

// tmpSuffix names the one temporary file a sync writes before renaming it
// over the map file. A fixed name (the state directory's lock guarantees a
// single writer) means a crash leaves at most one stale temp file, which the
// next open removes.
const tmpSuffix = atomicfile.TempSuffix

func openFile(cfg Config) (Map, OpenInfo, error) {
	info := OpenInfo{Kind: KindFile}
	dir := filepath.Dir(cfg.FilePath)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, info, fmt.Errorf("cannot create directory of ipcache map file %s: %w", cfg.FilePath, err)
	}
	// The state directory's lock keeps a second agent out already; this
	// one keeps out any other opener of the same file, as the pin's lock
	// does for the bpf backend.
	lock, err := lockMap(cfg.FilePath, cfg.FilePath+FileLockSuffix, false)
	if err != nil {
		return nil, info, err
	}
	m, err := openFileLocked(cfg, &info)
	if err != nil {
		lock.release()
		return nil, info, err
	}
	m.lock = lock
	return m, info, nil
}

func openFileLocked(cfg Config, info *OpenInfo) (*fileMap, error) {
	if err := os.Remove(cfg.FilePath + tmpSuffix); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("cannot remove stale temporary file: %w", err)
	}

	entries := map[rawKey]rawValue{}
	data, err := readMapFile(cfg.FilePath)
	// The snapshot the journal must name to be replayed over entries.
	base := journal.BaseOf(data)
	var bad error
	switch {
	case errors.Is(err, fs.ErrNotExist):
		info.Created = true
		info.Reason = fmt.Sprintf("created map file %s", cfg.FilePath)
	case errors.Is(err, errNotRegular):
		bad = err
	case err != nil:
		return nil, fmt.Errorf("cannot read ipcache map file: %w", err)
	default:
		raw, derr := decodeFile(data)
		if derr != nil {
			bad = derr
			break
		}
		entries = raw
		info.Snapshot = rawEntries(raw)
		info.Reason = fmt.Sprintf("loaded map file %s with %d entries", cfg.FilePath, len(raw))
		if len(raw) > int(cfg.MaxEntries) {
			info.Warnings = append(info.Warnings, fmt.Sprintf("map file %s holds %d entries, more than max entries %d; new keys are refused until it shrinks", cfg.FilePath, len(raw), cfg.MaxEntries))
		}
	}
	if bad != nil {
		// Keep the evidence for the operator, start empty: the agent
		// must come up, and restoration degrades to what the checkpoint
		// knows. Whatever is in the way (a corrupt file, a directory)
		// is moved, as the checkpoint loader does.
		aside, err := moveAside(cfg.FilePath, time.Now())
		if err != nil {
			return nil, fmt.Errorf("%s: %w; cannot move it aside: %w", cfg.FilePath, bad, err)
		}
		info.MovedAside = aside
		info.Warnings = append(info.Warnings, fmt.Sprintf("%s: %v; moved to %s, starting empty", cfg.FilePath, bad, aside))
		info.Created = true
		info.Reason = fmt.Sprintf("replaced corrupt map file %s with an empty one", cfg.FilePath)
	}
	f := &fileMap{
		path:      cfg.FilePath,
		max:       int(cfg.MaxEntries),
		syncDelay: cfg.SyncDelay,
		fault:     cfg.WriteFault,
		entries:   entries,
	}
	if cfg.Journal {
		if err := f.openJournal(info, base); err != nil {
			return nil, err
		}
	}
	return f, nil
}

// errNotRegular is the reason a path that holds something other than a
// regular file (a directory, a FIFO, a socket) is moved aside.
var errNotRegular = errors.New("not a regular file")

// readMapFile reads the map file, refusing anything but a regular file
// before opening it (opening a FIFO would block). A symbolic link is
// followed, as the checkpoint loader does.
func readMapFile(path string) ([]byte, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%w (%s)", errNotRegular, fi.Mode().Type())
	}
	return os.ReadFile(path)
}

// fileMap is the file backend: the records live in memory in their binary
// form (36 bytes of payload each) and Sync writes them all atomically.
type fileMap struct {
	path      string
	max       int
	syncDelay time.Duration
	fault     func(step string) error // Config.WriteFault

	// syncMu serializes file writes and guards buf; it is taken before mu.
	syncMu sync.Mutex
	buf    []byte

	mu      sync.RWMutex
	entries map[rawKey]rawValue
	dirty   bool
	closed  bool
	timer   *time.Timer // armed write-behind, nil when none
	timerWG sync.WaitGroup
	syncErr error // last write-behind failure, returned by the next Sync

	// lock keeps other openers off the file while the map is open.
	lock *mapLock

	// jrn logs every change when Config.Journal is set; nil otherwise.
	// Records are appended under mu, in the order of the changes.
	jrn *journal.Journal
	// pending holds the keys changed by records not yet durable, with
	// the number of their last record; guarded by mu.
	pending map[rawKey]uint64
	// rec is the scratch buffer of a record; guarded by mu.
	rec []byte
}

func (f *fileMap) Kind() Kind   { return KindFile }
func (f *fileMap) Path() string { return f.path }

func (f *fileMap) Lookup(k Key) (Value, bool, error) {
	var (
		rk rawKey
		v  Value
	)
	if err := k.put(&rk); err != nil {
		return v, false, err
	}
	addr := k.Prefix.Addr()
	f.mu.RLock()
	defer f.mu.RUnlock()
	if f.closed {
		return v, false, ErrClosed
	}
	// Longest prefix first, as the kernel's trie answers; at most 129
	// hash lookups, cheaper than keeping a trie beside the hash map.
	for bits := k.Prefix.Bits(); bits >= 0; bits-- {
		if bits != k.Prefix.Bits() {
			_ = Key{Prefix: netip.PrefixFrom(addr, bits), ClusterID: k.ClusterID}.put(&rk)
		}
		if rv, ok := f.entries[rk]; ok {
			v.get(&rv)
			return v, true, nil
		}
	}
	return v, false, nil
}

// changed marks the table dirty and arms the write-behind timer. Called
// with mu held. The timer is tracked: timerWG counts it from here until
// writeBehind returns or Close stops it, and Close waits for it before its
// final write, so no write runs after Close. (The agent leaves SyncDelay
// zero: the ipcache cell's ipcache-map-sync job calls Sync instead.)
func (f *fileMap) changed() {
	f.dirty = true
	if f.syncDelay > 0 && f.timer == nil {
		f.timerWG.Add(1)
		f.timer = time.AfterFunc(f.syncDelay, f.writeBehind)
	}
}

func (f *fileMap) writeBehind() {
	defer f.timerWG.Done()
	f.mu.Lock()
	f.timer = nil
	closed := f.closed
	f.mu.Unlock()
	if closed {
		return
	}
	if err := f.sync(); err != nil {
		f.mu.Lock()
		f.syncErr = err
		if !f.closed {
			f.changed() // retry after another delay
		}
		f.mu.Unlock()
	}
}

func (f *fileMap) putLocked(rk *rawKey, rv *rawValue) error {
	if _, ok := f.entries[*rk]; !ok && len(f.entries) >= f.max {
		var k Key
		_ = k.get(rk)
		return fmt.Errorf("update %s: %w (max %d entries)", k, ErrFull, f.max)
	}
	f.entries[*rk] = *rv
	return nil
}

func (f *fileMap) Update(k Key, v Value) error {
	var (
		rk rawKey
		rv rawValue
	)
	if err := k.put(&rk); err != nil {
		return err
	}
	if err := v.put(&rv); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return ErrClosed
	}
	if old, ok := f.entries[rk]; ok && old == rv {
		return nil // unchanged: no file write needed
	}
	if err := f.putLocked(&rk, &rv); err != nil {
		return err
	}
	f.logLocked(&rk, &rv)
	f.changed()
	return nil
}

func (f *fileMap) UpdateBatch(entries []Entry) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return ErrClosed
	}
	var (
		rk  rawKey
		rv  rawValue
		err error
	)
	n := 0
	for i := range entries {
		if err = entries[i].Key.put(&rk); err != nil {
			break
		}
		if err = entries[i].Value.put(&rv); err != nil {
			err = fmt.Errorf("%s: %w", entries[i].Key, err)
			break
		}
		if old, ok := f.entries[rk]; ok && old == rv {
			continue
		}
		if err = f.putLocked(&rk, &rv); err != nil {
			break
		}
		f.logLocked(&rk, &rv)
		n++
	}
	if n > 0 {
		f.changed()
	}
	return err
}

func (f *fileMap) Delete(k Key) error {
	var rk rawKey
	if err := k.put(&rk); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return ErrClosed
	}
	if _, ok := f.entries[rk]; ok {
		delete(f.entries, rk)
		f.logLocked(&rk, nil)
		f.changed()
	}
	return nil
}

func (f *fileMap) DeleteBatch(keys []Key) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return ErrClosed
	}
	var rk rawKey
	n := 0
	var err error
	for i := range keys {
		if err = keys[i].put(&rk); err != nil {
			break
		}
		if _, ok := f.entries[rk]; ok {
			delete(f.entries, rk)
			f.logLocked(&rk, nil)
			n++
		}
	}
	if n > 0 {
		f.changed()
	}
	return err
}

func (f *fileMap) Dump(yield func(Key, Value) bool) error {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if f.closed {
		return ErrClosed
	}
	for rk, rv := range f.entries {
		e, err := decodeEntry(&rk, &rv)
		if err != nil {
			continue
		}
		if !yield(e.Key, e.Value) {
			return nil
		}
	}
	return nil
}

func (f *fileMap) snapshot() ([]Entry, int, error) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if f.closed {
		return nil, 0, ErrClosed
	}
	return rawEntries(f.entries), 0, nil
}

func (f *fileMap) Len() (int, error) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if f.closed {
		return 0, ErrClosed
	}
	return len(f.entries), nil
}

func (f *fileMap) Sync() error {
	f.mu.Lock()
	closed, bgErr := f.closed, f.syncErr
	f.syncErr = nil
	f.mu.Unlock()
	if closed {
		return ErrClosed
	}
	if err := f.sync(); err != nil {
		return err
	}
	if bgErr != nil {
		// The failed background write has been superseded by this one;
		// still tell the caller that durability lagged.
		return fmt.Errorf("earlier write-behind failed (now recovered): %w", bgErr)
	}
	return nil
}

// sync makes the changes durable: the journal's new records when there is
// a journal, else the whole file if it changed since its last write.
func (f *fileMap) sync() error {
	if f.jrn != nil {
		return f.syncJournal(f.jrn.Appended())
	}
	return f.writeWhole()
}

// writeWhole writes the table if it changed since the last successful
// write.
func (f *fileMap) writeWhole() error {
	f.syncMu.Lock()
	defer f.syncMu.Unlock()
	f.mu.Lock()
	if !f.dirty {
		f.mu.Unlock()
		return nil
	}
	// Encoding under the lock is a memory copy (about 36 MB for 1M
	// entries); the slow part, writing and fsync, runs without it so that
	// updates and lookups go on meanwhile.
	f.buf = encodeFile(f.buf, f.entries)
	f.dirty = false
	f.mu.Unlock()

	if err := writeFileAtomic(f.path, f.buf, f.fault); err != nil {
		f.mu.Lock()
		f.dirty = true
		f.mu.Unlock()
		return err
	}
	return nil
}

func (f *fileMap) Close() error {
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		return nil
	}
	f.closed = true
	if f.timer != nil && f.timer.Stop() {
		f.timer = nil
		f.timerWG.Done()
	}
	f.mu.Unlock()
	// A write-behind already running finishes first; then the final write.
	f.timerWG.Wait()
	var err error
	if f.jrn != nil {
		// The last snapshot: a clean stop leaves an empty journal. If it
		// fails, the journal keeps the changes instead.
		if err = f.Compact(); err != nil {
			err = errors.Join(err, f.syncJournal(f.jrn.Appended()))
		}
		err = errors.Join(err, f.jrn.Close())
	} else {
		err = f.sync()
	}
	f.mu.Lock()
	f.entries = nil
	f.buf = nil
	f.mu.Unlock()
	// The final write is done: only now may another agent take the file.
	return errors.Join(err, f.lock.release())
}

// writeFileAtomic replaces path with data so that a crash at any moment
// leaves either the old or the new contents; fault is WriteSteps'.
func writeFileAtomic(path string, data []byte, fault func(step string) error) error {
	if err := atomicfile.WriteSteps(path, data, fault); err != nil {
		return fmt.Errorf("cannot replace %s: %w", path, err)
	}
	return nil
}

// moveAside renames a corrupt file to <path>.corrupt-<unix time>, adding
// .1, .2, … when that name is taken, so that no earlier evidence is
// overwritten.
func moveAside(path string, now time.Time) (string, error) {
	return moveAsideAs(path, path+".corrupt-"+strconv.FormatInt(now.Unix(), 10), ".")
}

// moveAsideAs renames path to base, or to base<sep>1, base<sep>2, … when
// taken. The caller holds the lock beside path, so no other agent creates
// names there between the check and the rename.
func moveAsideAs(path, base, sep string) (string, error) {
	for i := 0; i < 1000; i++ {
		aside := base
		if i > 0 {
			aside += sep + strconv.Itoa(i)
		}
		if _, err := os.Lstat(aside); err == nil {
			continue
		}
		if err := os.Rename(path, aside); err != nil {
			return "", err
		}
		_ = atomicfile.SyncDir(filepath.Dir(path))
		return aside, nil
	}
	return "", fmt.Errorf("too many files named %s*", base)
}
