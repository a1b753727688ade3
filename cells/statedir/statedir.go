// Package statedir provides the agent's state directory (--state-dir): the
// place of the checkpoint, the embedded etcd's data, the file-backed
// datapath map and the shell socket.
//
// On start the directory is created with mode 0700 (an existing one is
// tightened to 0700; one owned by another user than the agent's is refused
// with ErrNotOwner) and an exclusive lock is taken on
// <state-dir>/identityd.lock, so that a second agent on the same directory
// fails with a clear error instead of sharing or taking over its files.
package statedir

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/cilium/hive/cell"
	"github.com/spf13/pflag"
)

// Cell provides *Dir.
var Cell = cell.Module(
	"statedir",
	"Agent state directory",

	cell.Config(DefaultConfig),
	cell.Provide(newDir),
)

// Config is the state directory's configuration.
type Config struct {
	// StateDir is where the agent keeps its state.
	StateDir string
}

// DefaultConfig is the default configuration.
var DefaultConfig = Config{StateDir: "/var/run/identityd"}

// Flags registers --state-dir.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.String("state-dir", def.StateDir, "Directory of the agent's state (checkpoint, embedded etcd, datapath map file, shell socket); created 0700")
}

// LockFileName is the name of the instance lock inside the state directory.
const LockFileName = "identityd.lock"

// ErrLocked is returned when another process holds the state directory.
var ErrLocked = errors.New("state directory is in use by another identityd")

// ErrNotOwner is returned when the state directory belongs to another user.
var ErrNotOwner = errors.New("state directory is owned by another user")

// Dir is the state directory.
type Dir struct {
	path string
	log  *slog.Logger
	lock *os.File
}

func newDir(lc cell.Lifecycle, log *slog.Logger, cfg Config) (*Dir, error) {
	if cfg.StateDir == "" {
		return nil, errors.New("--state-dir must not be empty")
	}
	abs, err := filepath.Abs(cfg.StateDir)
	if err != nil {
		return nil, fmt.Errorf("state directory %q: %w", cfg.StateDir, err)
	}
	d := &Dir{path: abs, log: log}
	lc.Append(d)
	return d, nil
}

// New returns a Dir for path without a lifecycle, for tests and tools that
// read state of an agent that is not running. Call Prepare before use.
func New(path string) *Dir { return &Dir{path: path, log: slog.Default()} }

// Path returns the absolute path of the directory.
func (d *Dir) Path() string { return d.path }

// Join returns the path of a file inside the directory.
func (d *Dir) Join(elem ...string) string {
	return filepath.Join(append([]string{d.path}, elem...)...)
}

// Prepare creates the directory with mode 0700, or tightens an existing one
// that the agent's user owns; another user's directory is refused.
func (d *Dir) Prepare() error {
	if err := os.MkdirAll(d.path, 0o700); err != nil {
		return fmt.Errorf("cannot create state directory %s: %w", d.path, err)
	}
	fi, err := os.Stat(d.path)
	if err != nil {
		return fmt.Errorf("cannot stat state directory %s: %w", d.path, err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("state directory %s is not a directory", d.path)
	}
	// The owner of the directory can read, replace or remove every state
	// file in it whatever their modes: only the agent's own user may own
	// it. (Tightening another user's directory to 0700 would hide nothing
	// from that user.)
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && int(st.Uid) != os.Geteuid() {
		return fmt.Errorf("%w: %s is owned by uid %d, the agent runs as uid %d; chown it to the agent's user or choose another --state-dir",
			ErrNotOwner, d.path, st.Uid, os.Geteuid())
	}
	if fi.Mode().Perm() != 0o700 {
		if err := os.Chmod(d.path, 0o700); err != nil {
			return fmt.Errorf("cannot set mode 0700 on state directory %s: %w", d.path, err)
		}
	}
	return nil
}

// Start prepares the directory and takes the instance lock.
func (d *Dir) Start(cell.HookContext) error {
	if err := d.Prepare(); err != nil {
		return err
	}
	lockPath := d.Join(LockFileName)
	f, err := os.OpenFile(lockPath, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("cannot open lock file %s: %w", lockPath, err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		holder, _ := os.ReadFile(lockPath)
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			pid := strings.TrimSpace(string(holder))
			if pid == "" {
				pid = "unknown"
			}
			return fmt.Errorf("%w: %s is locked by pid %s", ErrLocked, d.path, pid)
		}
		return fmt.Errorf("cannot lock %s: %w", lockPath, err)
	}
	if err := f.Truncate(0); err == nil {
		f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	d.lock = f
	d.log.Info("State directory ready", "path", d.path)
	return nil
}

// Stop releases the instance lock.
func (d *Dir) Stop(cell.HookContext) error {
	if d.lock != nil {
		// Closing the file drops the flock; the file stays so that its
		// inode (and so the lock) is the same for the next agent.
		err := d.lock.Close()
		d.lock = nil
		return err
	}
	return nil
}
