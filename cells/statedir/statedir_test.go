package statedir

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
)

func start(t *testing.T, path string) (*Dir, *hive.Hive, error) {
	var d *Dir
	h := hive.New(Cell, cell.Invoke(func(x *Dir) { d = x }))
	hive.AddConfigOverride(h, func(c *Config) { c.StateDir = path })
	err := h.Start(hivetest.Logger(t), context.Background())
	return d, h, err
}

func TestCreatesAndLocks(t *testing.T) {
	path := filepath.Join(t.TempDir(), "a", "state")
	d, h, err := start(t, path)
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
	_, h2, err := start(t, path)
	if !errors.Is(err, ErrLocked) {
		t.Fatalf("second start: %v, want ErrLocked", err)
	}
	h2.Stop(hivetest.Logger(t), context.Background())
	// After the first stops, the directory can be taken again.
	if err := h.Stop(hivetest.Logger(t), context.Background()); err != nil {
		t.Fatal(err)
	}
	_, h3, err := start(t, path)
	if err != nil {
		t.Fatalf("start after stop: %v", err)
	}
	h3.Stop(hivetest.Logger(t), context.Background())
}

func TestTightensMode(t *testing.T) {
	path := t.TempDir()
	os.Chmod(path, 0o755)
	_, h, err := start(t, path)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Stop(hivetest.Logger(t), context.Background())
	if fi, _ := os.Stat(path); fi.Mode().Perm() != 0o700 {
		t.Fatalf("mode %v, want 0700", fi.Mode().Perm())
	}
}

func TestNotADirectory(t *testing.T) {
	file := filepath.Join(t.TempDir(), "f")
	os.WriteFile(file, nil, 0o600)
	_, h, err := start(t, file)
	h.Stop(hivetest.Logger(t), context.Background())
	if err == nil {
		t.Fatal("a file was accepted as the state directory")
	}
}
