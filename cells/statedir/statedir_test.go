package statedir

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"

	"github.com/identityd/identityd/internal/testhive"
)

// start starts a hive with the state directory at path; it stops when the
// test ends. A start that fails leaves nothing to stop: the directory's
// hook is the hive's only one.
func start(t *testing.T, path string) (*Dir, *testhive.Running, error) {
	var d *Dir
	h := hive.New(Cell, cell.Invoke(func(x *Dir) { d = x }))
	hive.AddConfigOverride(h, func(c *Config) { c.StateDir = path })
	r, err := testhive.TryStart(t, h, nil)
	return d, r, err
}

func TestCreatesAndLocks(t *testing.T) {
	path := filepath.Join(t.TempDir(), "a", "state")
	d, r, err := start(t, path)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil || !fi.IsDir() || fi.Mode().Perm() != 0o700 {
		t.Fatalf("state dir %v, %v; want a 0700 directory", fi, err)
	}
	if d.Join("x") != filepath.Join(path, "x") {
		t.Fatal("Join")
	}
	// A second agent on the same directory fails with a clear error.
	if _, _, err := start(t, path); !errors.Is(err, ErrLocked) {
		t.Fatalf("second start: %v, want ErrLocked", err)
	}
	// After the first stops, the directory can be taken again.
	r.Stop()
	if _, _, err := start(t, path); err != nil {
		t.Fatalf("start after stop: %v", err)
	}
}

func TestTightensMode(t *testing.T) {
	path := t.TempDir()
	os.Chmod(path, 0o755)
	if _, _, err := start(t, path); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(path); fi.Mode().Perm() != 0o700 {
		t.Fatalf("mode %v, want 0700", fi.Mode().Perm())
	}
}

func TestNotADirectory(t *testing.T) {
	file := filepath.Join(t.TempDir(), "f")
	os.WriteFile(file, nil, 0o600)
	if _, _, err := start(t, file); err == nil {
		t.Fatal("a file was accepted as the state directory")
	}
}

// TestOwnedByAnotherUser gives the state directory to uid 65534: the
// agent (root here) must refuse it with a clear error, and leave its mode
// and contents alone, instead of keeping its state where that user can
// read and replace it.
func TestOwnedByAnotherUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to give a directory to another user (uid 65534)")
	}
	path := filepath.Join(t.TempDir(), "state")
	if err := os.Mkdir(path, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(path, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	_, _, err := start(t, path)
	if !errors.Is(err, ErrNotOwner) {
		t.Fatalf("start on another user's directory: %v, want ErrNotOwner", err)
	}
	for _, want := range []string{path, "uid 65534", "uid 0"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %q", err, want)
		}
	}
	fi, _ := os.Stat(path)
	if fi.Mode().Perm() != 0o755 {
		t.Errorf("mode changed to %v", fi.Mode().Perm())
	}
	if _, err := os.Stat(filepath.Join(path, LockFileName)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("lock file created in another user's directory: %v", err)
	}
	// Given back to the agent's user, it is used (and tightened).
	if err := os.Chown(path, 0, 0); err != nil {
		t.Fatal(err)
	}
	_, r, err := start(t, path)
	if err != nil {
		t.Fatal(err)
	}
	r.Stop()
	if fi, _ := os.Stat(path); fi.Mode().Perm() != 0o700 {
		t.Fatalf("mode %v, want 0700", fi.Mode().Perm())
	}
}
