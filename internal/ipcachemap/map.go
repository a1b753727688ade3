package ipcachemap

import (
	"errors"
	"fmt"
	"time"
)

// Kind names a backend.
type Kind string

// Backends accepted by Config.Kind.
const (
	// KindAuto uses bpf when a map can be created and pinned, else file.
	KindAuto Kind = "auto"
	// KindBPF is a pinned BPF LPM trie.
	KindBPF Kind = "bpf"
	// KindFile is an in-memory table persisted to a file.
	KindFile Kind = "file"
)

// Defaults of Config.
const (
	// DefaultPinPath is where the bpf backend pins its map. It is
	// identityd's own map, never Cilium's tc/globals/cilium_ipcache*.
	DefaultPinPath = "/sys/fs/bpf/identityd/ipcache"
	// DefaultBPFFSRoot is where bpffs is mounted when it is not yet.
	DefaultBPFFSRoot = "/sys/fs/bpf"
	// DefaultMaxEntries is Cilium's fixed ipcache size.
	DefaultMaxEntries = 512000
	// FileName is the file backend's file name inside the state directory.
	FileName = "ipcache.map"
)

// ErrFull is wrapped by updates that fail because the map holds MaxEntries
// entries.
var ErrFull = errors.New("ipcache map is full")

// ErrClosed is returned by operations on a closed map.
var ErrClosed = errors.New("ipcache map is closed")

// Config selects and parameterizes the backend.
type Config struct {
	// Kind is auto (default when empty), bpf or file.
	Kind Kind
	// PinPath is the bpf backend's pin (default DefaultPinPath).
	PinPath string
	// BPFFSRoot is where bpffs is mounted if the pin's directory is not on
	// a bpffs (default DefaultBPFFSRoot).
	BPFFSRoot string
	// MaxEntries is the bpf map's capacity (default DefaultMaxEntries). A
	// pinned map of another capacity is replaced. The file backend enforces
	// it too, so that both backends fail alike when the ipcache outgrows it.
	MaxEntries uint32
	// FilePath is the file backend's file, normally
	// <state-dir>/ipcache.map. Required for kinds file and auto.
	FilePath string
	// SyncDelay, when positive, makes the file backend persist changes by
	// itself at most this long after the first unsynced change (write-behind).
	// Zero leaves persistence to explicit Sync calls and Close.
	SyncDelay time.Duration
	// WriteFault, when not nil, is called before each step of a write of
	// the file backend's file (atomicfile.WriteSteps) and of its journal,
	// for tests of a failing or stalled disk.
	WriteFault func(step string) error
	// Journal makes the file backend log every change to
	// <FilePath>.journal (JournalSuffix): Sync then writes the changes
	// since the last Sync, one small write whatever the map's size, and
	// the file becomes a snapshot that Compact writes. Without it Sync
	// rewrites the whole file.
	Journal bool
}

func (c Config) withDefaults() Config {
	if c.Kind == "" {
		c.Kind = KindAuto
	}
	if c.PinPath == "" {
		c.PinPath = DefaultPinPath
	}
	if c.BPFFSRoot == "" {
		c.BPFFSRoot = DefaultBPFFSRoot
	}
	if c.MaxEntries == 0 {
		c.MaxEntries = DefaultMaxEntries
	}
	return c
}

// Map is an ipcache datapath map. Implementations are safe for concurrent
// use, except that Close must not race other calls.
type Map interface {
	// Kind returns the backend's kind (bpf or file).
	Kind() Kind
	// Path returns the pin path or the file path.
	Path() string

	// Lookup returns the value of the longest stored prefix that contains
	// k.Prefix, in k's cluster and family: the datapath's lookup. Pass a /32
	// or /128 prefix to look an address up.
	Lookup(k Key) (Value, bool, error)
	// Update inserts or replaces the entry of k.
	Update(k Key, v Value) error
	// Delete removes the entry of exactly k; deleting a missing key is not
	// an error, so reconcilers can retry freely.
	Delete(k Key) error
	// UpdateBatch inserts or replaces many entries with as few syscalls as
	// the kernel allows. On error some entries may have been written.
	UpdateBatch(entries []Entry) error
	// DeleteBatch removes many keys; missing keys are skipped.
	DeleteBatch(keys []Key) error

	// Dump calls yield for every entry, in no particular order, until yield
	// returns false. yield must not write to the map. Entries that cannot
	// be decoded (foreign writers) are skipped.
	Dump(yield func(Key, Value) bool) error
	// Len counts the entries. For bpf this walks the map.
	Len() (int, error)

	// Sync makes all changes so far durable: a no-op for bpf (the kernel
	// holds the map); for file, when anything changed, a write of the
	// journal's new records (Config.Journal) or an atomic write of the
	// whole file.
	Sync() error
	// SyncKeys makes the changes of the given keys durable, as Sync does,
	// and writes nothing when they are already: an unchanged entry costs
	// no write.
	SyncKeys(keys []Key) error
	// Compact writes the file backend's whole file and empties its
	// journal: the snapshot, which bounds the journal and the time a
	// restart takes to replay it. A no-op for bpf.
	Compact() error
	// Close syncs (file) and releases the map; a pinned bpf map stays.
	Close() error
}

// OpenInfo tells the caller what Open found and chose; the caller logs it.
type OpenInfo struct {
	// Kind is the backend in use.
	Kind Kind
	// Reason says why this backend, in one human-readable sentence.
	Reason string
	// Created is true when no previous map or file existed.
	Created bool
	// Snapshot holds the map's contents as found at open, read before
	// anything could write to it (also when an incompatible pinned map was
	// replaced, if its key and value sizes were readable).
	Snapshot []Entry
	// Skipped counts old entries that could not be decoded.
	Skipped int
	// Replaced describes an incompatible pinned map that was moved aside
	// (to MovedAside) and replaced by a new empty one; empty when none was.
	Replaced string
	// MovedAside is where a corrupt map file (or whatever else was at the
	// file's path, such as a directory) or an incompatible pinned map was
	// moved; empty when nothing was.
	MovedAside string
	// MountedBPFFS is where Open mounted a bpffs because none was
	// mounted; empty when it mounted nothing.
	MountedBPFFS string
	// Warnings are problems the caller should log as warnings.
	Warnings []string
	// JournalRecords is the number of journal records replayed over the
	// file (Config.Journal).
	JournalRecords int
	// JournalKeptAs is where a copy of a damaged journal was kept; empty
	// when none was damaged.
	JournalKeptAs string
	// JournalDamage is why the journal was not read as a whole
	// continuation of the file (a damaged record or header, an empty
	// file, another map file than the one read); empty when it was.
	// JournalSalvaged of its records replayed were found after the
	// damage, and JournalLostBytes of its bytes are in no record.
	JournalDamage    string
	JournalSalvaged  int
	JournalLostBytes int64
}

// Open opens or creates the map that cfg selects and snapshots its old
// contents. With KindAuto it tries bpf first and falls back to file,
// saying why in OpenInfo.Reason; a map that another agent holds
// (ErrInUse) is an error, never a reason to fall back.
//
// The open map holds an exclusive lock beside it (see PinLockSuffix, FileLockSuffix) until
// Close, so that two agents never share one map: the second Open fails
// with ErrInUse, naming the holder's pid when /proc/locks shows it. The
// OpenInfo is filled as far as Open got, also on error.
func Open(cfg Config) (Map, OpenInfo, error) {
	cfg = cfg.withDefaults()
	switch cfg.Kind {
	case KindBPF:
		return openBPF(cfg)
	case KindFile:
		if cfg.FilePath == "" {
			return nil, OpenInfo{}, errors.New("ipcache map kind file needs a file path")
		}
		return openFile(cfg)
	case KindAuto:
		m, info, err := openBPF(cfg)
		if err == nil {
			info.Reason = "auto: " + info.Reason
			return m, info, nil
		}
		if errors.Is(err, ErrInUse) {
			// bpf works, but another agent owns the map: a file map
			// instead would leave this agent without a datapath.
			return nil, info, err
		}
		if cfg.FilePath == "" {
			return nil, info, fmt.Errorf("bpf ipcache map unavailable and no file path for the file backend: %w", err)
		}
		fm, finfo, ferr := openFile(cfg)
		finfo.MountedBPFFS = info.MountedBPFFS
		if ferr != nil {
			return nil, finfo, fmt.Errorf("bpf ipcache map unavailable (%v), file backend failed: %w", err, ferr)
		}
		finfo.Reason = fmt.Sprintf("auto: bpf backend unavailable (%v); %s", err, finfo.Reason)
		return fm, finfo, nil
	default:
		return nil, OpenInfo{}, fmt.Errorf("unknown ipcache map kind %q (want auto, bpf or file)", cfg.Kind)
	}
}

// Snapshot reads all entries of m into a slice. Open already returns the
// contents found at open in OpenInfo.Snapshot; this is for tools and tests.
func Snapshot(m Map) ([]Entry, error) {
	// Both backends read everything in one pass; Len+Dump would walk a bpf
	// map twice.
	if s, ok := m.(interface{ snapshot() ([]Entry, int, error) }); ok {
		out, _, err := s.snapshot()
		return out, err
	}
	var out []Entry
	if n, err := m.Len(); err == nil {
		out = make([]Entry, 0, n)
	}
	err := m.Dump(func(k Key, v Value) bool {
		out = append(out, Entry{Key: k, Value: v})
		return true
	})
	return out, err
}
