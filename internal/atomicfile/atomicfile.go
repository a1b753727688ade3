// Package atomicfile replaces a file so that a crash at any moment leaves
// either its old or its new contents, and the new ones survive a power
// loss once the write returns: the one way identityd writes its state
// files (the checkpoint, the ipcache map file).
package atomicfile

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// TempSuffix names the temporary file of a write, beside the file it
// replaces. It is fixed rather than random: the state directory's lock
// keeps a single writer, so a write interrupted by a crash leaves at most
// one stray file, which the next write replaces.
const TempSuffix = ".tmp"

// Write replaces path with data: data goes to a new temporary file in the
// same directory (mode 0600), which is fsynced, renamed over path, and
// then the directory is fsynced so that the rename itself is durable.
// Readers see either the old or the new content, never a mix. On error the
// previous file is untouched and the temporary file removed.
func Write(path string, data []byte) error {
	return WriteSteps(path, data, nil)
}

// WriteSteps is Write with fault, when not nil, called before each step
// (write, fsync, close, rename, fsync directory) with the step's name; an
// error it returns fails that step, for tests of a failure at each.
func WriteSteps(path string, data []byte, fault func(step string) error) (err error) {
	tmp := path + TempSuffix
	// A leftover from a crashed write may exist with any mode; creating
	// afresh with O_EXCL guarantees 0600 and that nobody else holds it.
	if err := os.Remove(tmp); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove stale temporary file: %w", err)
	}
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("create temporary file: %w", err)
	}
	renamed := false
	defer func() {
		if f != nil {
			f.Close()
		}
		if !renamed {
			os.Remove(tmp)
		}
	}()
	step := func(name string, fn func() error) error {
		if fault != nil {
			if err := fault(name); err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
		}
		if err := fn(); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		return nil
	}
	if err := step("write", func() error { _, err := f.Write(data); return err }); err != nil {
		return err
	}
	if err := step("fsync", f.Sync); err != nil {
		return err
	}
	err = step("close", f.Close)
	f = nil
	if err != nil {
		return err
	}
	if err := step("rename", func() error { return os.Rename(tmp, path) }); err != nil {
		return err
	}
	renamed = true
	return step("fsync directory", func() error { return SyncDir(filepath.Dir(path)) })
}

// SyncDir makes a rename or a removal in dir durable.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
