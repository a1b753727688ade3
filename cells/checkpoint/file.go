package checkpoint

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"strconv"
	"syscall"
	"time"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/atomicfile"
	"github.com/identityd/identityd/internal/journal"
)

// FileName is the checkpoint's name in the state directory, the same as
// Cilium's, so that either agent can restore from the other's file.
const FileName = "local_allocator_state.json"

// MaxFileSize bounds the checkpoint that Load reads. The largest real
// checkpoint, every ID of both local scopes (2 × 2^24) at ~133 bytes, would
// be far larger, but memory for such a file would not exist either; 256 MiB
// holds about two million CIDR identities, ten times what a node uses.
// A larger file is treated as corrupt instead of being read into memory.
const MaxFileSize = 256 << 20

// tempSuffix names the temporary file of a write.
const tempSuffix = atomicfile.TempSuffix

// WriteFile replaces path with data atomically and durably: data goes to
// a temporary file in the same directory (mode 0600), which is fsynced,
// renamed over path, and then the directory is fsynced so that the rename
// itself survives a power loss. Readers see either the old or the new
// content, never a mix. On error the previous file is untouched and the
// temporary file removed.
func WriteFile(path string, data []byte) error {
	return atomicfile.Write(path, data)
}

// writeFile is WriteFile with a hook that runs between the steps, for
// tests of failures at each of them.
func writeFile(path string, data []byte, fault func(step string) error) error {
	return atomicfile.WriteSteps(path, data, fault)
}

// LoadResult is what Load found.
type LoadResult struct {
	// Identities are the valid entries, to be restored.
	Identities []identity.Identity
	// Report says how the file was read.
	Report Report
	// Seen holds every local number the state files name that Load
	// could read: the checkpoint, every record of the journal, and the
	// copies of both kept aside by this or an earlier start, with
	// repeats (Checkpoint.Load only). Restoration withholds those it does
	// not restore until its grace period ends: after damage, an answered
	// number may be named nowhere else.
	Seen []identity.NumericIdentity
}

// Report describes one load of the checkpoint.
type Report struct {
	// Path is the file that was read.
	Path string
	// Found is false when there was no file: nothing to restore.
	Found bool
	// Size is the file's size in bytes.
	Size int64
	// Valid is the number of restorable entries.
	Valid int
	// Invalid lists the entries that were skipped, by index.
	Invalid []InvalidEntry
	// Corrupt is why the whole file was unusable (unreadable, not a
	// checkpoint, or over MaxFileSize), or nil.
	Corrupt error
	// SetAside is where the original file was kept when it was corrupt or
	// had invalid entries, so that it can be examined later; empty if it
	// was not.
	SetAside string
	// Duration is the time the load took.
	Duration time.Duration
	// Journal describes the journal replayed over the file (Checkpoint.Load
	// only; Loader.Load reads the file alone).
	Journal JournalReport
	// CopiesRead is the number of set-aside copies whose numbers are in
	// LoadResult.Seen (Checkpoint.Load only).
	CopiesRead int
}

// Loader reads checkpoints. Its zero value is usable; set Log to have set
// aside files logged.
type Loader struct {
	// Log receives a warning for every file set aside.
	Log *slog.Logger
	// MaxSize overrides MaxFileSize when positive.
	MaxSize int64
	// Now returns the time that names set-aside files; time.Now if nil.
	Now func() time.Time
}

// ErrTooLarge is the reason of a file over the size bound.
var ErrTooLarge = errors.New("checkpoint exceeds the size bound")

// Load reads and decodes the checkpoint at path for restoration.
//
// A missing file is not an error: there is nothing to restore. A file that
// cannot be read, is not a checkpoint, or exceeds the size bound is
// renamed to <path>.corrupt-<unix time> (never deleted or overwritten) and
// reported in Report.Corrupt: the agent then starts without restoration.
// A file with some invalid entries is restored partially, and a copy of it
// is kept as <path>.invalid-<unix time> because the next checkpoint will no
// longer hold those entries.
//
// The error is non-nil only when a bad file could not be kept aside; the
// caller must then not overwrite it.
func (l Loader) Load(path string) (LoadResult, error) {
	res, _, err := l.loadBase(path)
	return res, err
}

// loadBase is Load that also returns the journal.Base of the bytes it read
// (the zero Base when there was no file): the snapshot a journal beside
// the file must name to be replayed over it.
func (l Loader) loadBase(path string) (LoadResult, journal.Base, error) {
	t0 := time.Now()
	res, base, err := l.load(path)
	res.Report.Duration = time.Since(t0)
	return res, base, err
}

func (l Loader) load(path string) (LoadResult, journal.Base, error) {
	res := LoadResult{Report: Report{Path: path}}
	rep := &res.Report
	maxSize := l.MaxSize
	if maxSize <= 0 {
		maxSize = MaxFileSize
	}
	data, size, err := readBounded(path, maxSize)
	base := journal.BaseOf(data)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return res, base, nil
	case err != nil:
		rep.Found, rep.Size = true, size
		rep.Corrupt = err
		return res, base, l.setAside(path, "corrupt", err, rep, moveNoReplace)
	}
	rep.Found, rep.Size = true, size
	ids, invalid, err := Decode(data)
	if err != nil {
		rep.Corrupt = err
		return res, base, l.setAside(path, "corrupt", err, rep, moveNoReplace)
	}
	res.Identities = ids
	rep.Valid = len(ids)
	rep.Invalid = invalid
	if len(invalid) > 0 {
		reason := fmt.Errorf("%d invalid entries, first: %s", len(invalid), invalid[0])
		return res, base, l.setAside(path, "invalid", reason, rep, copyFile)
	}
	return res, base, nil
}

// readBounded reads the file at path unless it is larger than maxSize. The
// size is checked on the open file and the read is bounded as well, so a
// file growing meanwhile cannot make it read more.
func readBounded(path string, maxSize int64) ([]byte, int64, error) {
	// Non-blocking, so that a FIFO at the path (which would block the
	// open until a writer came) is found not to be a regular file.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, 0, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, 0, fmt.Errorf("stat: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return nil, fi.Size(), fmt.Errorf("%w: not a regular file (%s)", ErrCorrupt, fi.Mode().Type())
	}
	size := fi.Size()
	if size > maxSize {
		return nil, size, fmt.Errorf("%w: %w: %d bytes, at most %d", ErrCorrupt, ErrTooLarge, size, maxSize)
	}
	data := make([]byte, size+1)
	n, err := io.ReadFull(f, data)
	switch {
	case err == nil:
		return nil, size, fmt.Errorf("%w: %w: file grew while being read", ErrCorrupt, ErrTooLarge)
	case errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF):
		return data[:n], int64(n), nil
	default:
		return nil, size, fmt.Errorf("read: %w", err)
	}
}

// setAside keeps the file at path under a new name that does not exist
// yet, by moving (corrupt file) or copying (partially valid file) it.
func (l Loader) setAside(path, kind string, reason error, rep *Report, keep func(from, to string) error) error {
	now := time.Now
	if l.Now != nil {
		now = l.Now
	}
	base := path + "." + kind + "-" + strconv.FormatInt(now().Unix(), 10)
	var lastErr error
	for i := 0; i < 1000; i++ {
		to := base
		if i > 0 {
			to = base + "-" + strconv.Itoa(i)
		}
		if _, err := os.Lstat(to); err == nil {
			continue
		} else if !errors.Is(err, fs.ErrNotExist) {
			lastErr = err
			break
		}
		if err := keep(path, to); err != nil {
			if errors.Is(err, fs.ErrExist) {
				continue
			}
			lastErr = err
			break
		}
		rep.SetAside = to
		if l.Log != nil {
			l.Log.Warn("Checkpoint set aside, its identities are not (all) restored",
				"file", path, "kept-as", to, "reason", reason)
		}
		return nil
	}
	if lastErr == nil {
		lastErr = errors.New("no free name")
	}
	err := fmt.Errorf("cannot keep %s checkpoint %s aside: %w", kind, path, lastErr)
	if l.Log != nil {
		l.Log.Error("Checkpoint cannot be set aside", "file", path, "reason", reason, "error", lastErr)
	}
	return err
}

// moveNoReplace renames from to to unless to exists. A hard link refuses
// an existing name atomically; where links are impossible (a directory, some
// file systems) the caller's existence check before the rename has to do,
// which is enough because the state directory's lock keeps other agents out.
func moveNoReplace(from, to string) error {
	err := os.Link(from, to)
	switch {
	case err == nil:
		return os.Remove(from)
	case errors.Is(err, fs.ErrExist):
		return err
	}
	return os.Rename(from, to)
}

// copyFile copies from to a new file to, failing if to exists.
func copyFile(from, to string) error {
	src, err := os.Open(from)
	if err != nil {
		return err
	}
	defer src.Close()
	dst, err := os.OpenFile(to, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	if _, err := io.Copy(dst, src); err != nil {
		dst.Close()
		os.Remove(to)
		return err
	}
	if err := dst.Sync(); err != nil {
		dst.Close()
		os.Remove(to)
		return err
	}
	return dst.Close()
}
