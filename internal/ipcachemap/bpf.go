//go:build linux

package ipcachemap

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/rlimit"
	"golang.org/x/sys/unix"
)

// batchSize bounds the entries per batch syscall: large enough that syscall
// cost vanishes, small enough that buffers stay in cache and a 1M-entry
// update does not need a second copy of everything.
const batchSize = 4096

// incompatibleSuffix (and the unix time) names a pinned map of another
// layout once it is moved aside. bpffs refuses names with a '.'.
const incompatibleSuffix = "-incompatible-"

// mapName is the kernel-visible name (at most 15 characters).
const mapName = "identityd_ipc"

func bpfSpec(maxEntries uint32) *ebpf.MapSpec {
	return &ebpf.MapSpec{
		Name:       mapName,
		Type:       ebpf.LPMTrie,
		KeySize:    KeySize,
		ValueSize:  ValueSize,
		MaxEntries: maxEntries,
		// The kernel requires NO_PREALLOC for LPM tries; it also means an
		// empty 1M-entry map costs nothing until it fills.
		Flags: unix.BPF_F_NO_PREALLOC,
	}
}

// layoutMismatch describes how a pinned map differs from want, or returns ""
// when it can be reused as is.
func layoutMismatch(m *ebpf.Map, want *ebpf.MapSpec) string {
	var diffs []string
	if m.Type() != want.Type {
		diffs = append(diffs, fmt.Sprintf("type %s, want %s", m.Type(), want.Type))
	}
	if m.KeySize() != want.KeySize {
		diffs = append(diffs, fmt.Sprintf("key size %d, want %d", m.KeySize(), want.KeySize))
	}
	if m.ValueSize() != want.ValueSize {
		diffs = append(diffs, fmt.Sprintf("value size %d, want %d", m.ValueSize(), want.ValueSize))
	}
	if m.MaxEntries() != want.MaxEntries {
		diffs = append(diffs, fmt.Sprintf("max entries %d, want %d", m.MaxEntries(), want.MaxEntries))
	}
	if m.Flags() != want.Flags {
		diffs = append(diffs, fmt.Sprintf("flags %#x, want %#x", m.Flags(), want.Flags))
	}
	return strings.Join(diffs, ", ")
}

// ensureBPFFS makes sure dir will live on a bpffs, mounting one at root when
// dir is below root and nothing is mounted there yet. It reports whether
// it mounted one: a mount changes the host, so the caller logs it.
func ensureBPFFS(dir, root string) (mounted bool, err error) {
	if onBPFFS(dir) {
		return false, nil
	}
	rel, err := filepath.Rel(root, dir)
	if err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
		return false, fmt.Errorf("pin directory %s is not on a bpffs and not below %s", dir, root)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(root, &st); err == nil && st.Type == unix.BPF_FS_MAGIC {
		return false, nil
	}
	if err := os.MkdirAll(root, 0o755); err != nil {
		return false, fmt.Errorf("cannot create bpffs mount point %s: %w", root, err)
	}
	if err := unix.Mount("bpffs", root, "bpf", 0, ""); err != nil {
		return false, fmt.Errorf("cannot mount bpffs at %s: %w", root, err)
	}
	return true, nil
}

// onBPFFS reports whether the nearest existing ancestor of dir is on a
// bpffs. A missing directory inherits its parent's file system.
func onBPFFS(dir string) bool {
	for d := filepath.Clean(dir); ; d = filepath.Dir(d) {
		var st unix.Statfs_t
		err := unix.Statfs(d, &st)
		if err == nil {
			return st.Type == unix.BPF_FS_MAGIC
		}
		if !errors.Is(err, unix.ENOENT) || d == filepath.Dir(d) {
			return false
		}
	}
}

func openBPF(cfg Config) (Map, OpenInfo, error) {
	info := OpenInfo{Kind: KindBPF}
	// Kernels before 5.11 charge maps to RLIMIT_MEMLOCK, which is far too
	// small for a 1M-entry trie; newer kernels make this a no-op.
	_ = rlimit.RemoveMemlock()

	dir := filepath.Dir(cfg.PinPath)
	mounted, err := ensureBPFFS(dir, cfg.BPFFSRoot)
	if err != nil {
		return nil, info, err
	}
	if mounted {
		info.MountedBPFFS = cfg.BPFFSRoot
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, info, fmt.Errorf("cannot create pin directory %s: %w", dir, err)
	}

	// Nothing at the pin is read before the lock is held: a second agent
	// must fail here, before its snapshot or its pruning can touch the
	// first agent's entries.
	// The lock is the pinned object's: a pin path that is a symlink (or
	// lies under one) to another agent's pin locks that agent's lock.
	pin, name := resolvePin(cfg.PinPath), cfg.PinPath
	if pin != cfg.PinPath {
		name = fmt.Sprintf("%s (a symlink to %s)", cfg.PinPath, pin)
	}
	lock, err := lockMap(name, pin+PinLockSuffix, true)
	if err != nil {
		return nil, info, err
	}
	m, err := openPinned(cfg, &info)
	if err != nil {
		lock.release()
		return nil, info, err
	}
	m.lock = lock
	return m, info, nil
}

// resolvePin returns path with its symlinks resolved: the pin itself when
// it exists, else its directory; path as given when neither resolves.
func resolvePin(path string) string {
	if p, err := filepath.EvalSymlinks(path); err == nil {
		return p
	}
	if d, err := filepath.EvalSymlinks(filepath.Dir(path)); err == nil {
		return filepath.Join(d, filepath.Base(path))
	}
	return path
}

// openPinned opens, creates or replaces the map at the pin; the caller
// holds the pin's lock.
func openPinned(cfg Config, info *OpenInfo) (*bpfMap, error) {
	spec := bpfSpec(cfg.MaxEntries)
	old, err := ebpf.LoadPinnedMap(cfg.PinPath, nil)
	switch {
	case errors.Is(err, os.ErrNotExist):
		m, err := createPinned(spec, cfg.PinPath)
		if err != nil {
			return nil, err
		}
		info.Created = true
		info.Reason = fmt.Sprintf("created and pinned BPF LPM trie %s (max %d entries)", cfg.PinPath, cfg.MaxEntries)
		return m, nil

	case errors.Is(err, unix.EPERM):
		return nil, fmt.Errorf("cannot open pinned map %s: %s: %w", cfg.PinPath, bpfRefusal(), err)
	case err != nil:
		return nil, fmt.Errorf("cannot open pinned map %s (is something other than a map pinned there?): %w", cfg.PinPath, err)
	}

	mismatch := layoutMismatch(old, spec)
	if mismatch == "" {
		m := &bpfMap{m: old, path: cfg.PinPath}
		info.Snapshot, info.Skipped, err = m.snapshot()
		if err != nil {
			old.Close()
			return nil, fmt.Errorf("cannot read pinned map %s: %w", cfg.PinPath, err)
		}
		info.Reason = fmt.Sprintf("reusing pinned BPF LPM trie %s with %d entries", cfg.PinPath, len(info.Snapshot))
		return m, nil
	}

	// A map of another layout is never reused: the datapath would read it
	// with the wrong layout or capacity. Its contents are still worth
	// restoring when its records have our sizes (e.g. only max entries
	// changed).
	info.Replaced = fmt.Sprintf("pinned map %s had %s", cfg.PinPath, mismatch)
	if old.KeySize() == KeySize && old.ValueSize() == ValueSize {
		tmp := &bpfMap{m: old, path: cfg.PinPath}
		info.Snapshot, info.Skipped, err = tmp.snapshot()
		if err != nil {
			info.Warnings = append(info.Warnings, fmt.Sprintf("cannot read replaced map %s, its entries are not restored: %v", cfg.PinPath, err))
		}
	} else {
		info.Warnings = append(info.Warnings, fmt.Sprintf("replaced map %s has key/value sizes %d/%d, its entries are not restored", cfg.PinPath, old.KeySize(), old.ValueSize()))
	}
	old.Close()
	// The old map is kept pinned under another name rather than
	// unpinned: whoever made it may still need it, and an unpinned map
	// nobody holds is gone for good.
	aside, err := moveAsideAs(cfg.PinPath, cfg.PinPath+incompatibleSuffix+strconv.FormatInt(time.Now().Unix(), 10), "-")
	if err != nil {
		return nil, fmt.Errorf("cannot move incompatible pinned map %s aside: %w", cfg.PinPath, err)
	}
	info.MovedAside = aside
	info.Warnings = append(info.Warnings, fmt.Sprintf("incompatible pinned map %s (%s) kept as %s; remove it once it is not needed, it holds kernel memory", cfg.PinPath, mismatch, aside))
	m, err := createPinned(spec, cfg.PinPath)
	if err != nil {
		return nil, err
	}
	info.Reason = fmt.Sprintf("replaced incompatible pinned map %s (%s, kept as %s) with a new BPF LPM trie (max %d entries)", cfg.PinPath, mismatch, aside, cfg.MaxEntries)
	return m, nil
}

func createPinned(spec *ebpf.MapSpec, path string) (*bpfMap, error) {
	m, err := ebpf.NewMap(spec)
	if errors.Is(err, unix.EPERM) {
		return nil, fmt.Errorf("cannot create BPF LPM trie: %s: %w", bpfRefusal(), err)
	}
	if err != nil {
		return nil, fmt.Errorf("cannot create BPF LPM trie: %w", err)
	}
	if err := m.Pin(path); err != nil {
		m.Close()
		return nil, fmt.Errorf("cannot pin map at %s: %w", path, err)
	}
	return &bpfMap{m: m, path: path}, nil
}

// Capability bits of /proc/<pid>/status's CapEff.
const (
	capSysAdmin = 21
	capBPF      = 39
)

// bpfRefusal says why the kernel answered a bpf(2) call with EPERM, which
// is about the caller, never about what is pinned: the thread lacks both
// CAP_BPF and CAP_SYS_ADMIN, or a seccomp filter refuses the call (the
// default profiles of some container runtimes allow bpf(2) only with
// CAP_SYS_ADMIN), or, with neither, a Linux security module refused it.
// It reads the calling thread's status, as both are per thread.
func bpfRefusal() string {
	data, err := os.ReadFile("/proc/thread-self/status")
	if err != nil {
		data, err = os.ReadFile("/proc/self/status")
	}
	if err != nil {
		return "bpf(2) refused: this process lacks CAP_BPF (CAP_SYS_ADMIN before Linux 5.8), or a seccomp filter refuses bpf(2)"
	}
	var capEff uint64
	seccomp := ""
	for line := range strings.Lines(string(data)) {
		k, v, _ := strings.Cut(line, ":")
		v = strings.TrimSpace(v)
		switch k {
		case "CapEff":
			capEff, _ = strconv.ParseUint(v, 16, 64)
		case "Seccomp":
			seccomp = v
		}
	}
	var causes []string
	if capEff&(1<<capBPF|1<<capSysAdmin) == 0 {
		causes = append(causes, "this process has neither CAP_BPF nor CAP_SYS_ADMIN: grant CAP_BPF (Linux 5.8 and later; CAP_SYS_ADMIN before)")
	}
	// 2 is SECCOMP_MODE_FILTER; 1 (strict) allows no bpf(2) at all.
	if seccomp == "1" || seccomp == "2" {
		causes = append(causes, "a seccomp filter is in force and may refuse bpf(2) (the default profiles of some container runtimes allow it only with CAP_SYS_ADMIN): run with a profile that allows bpf(2), or none (seccompProfile Unconfined)")
	}
	if len(causes) == 0 {
		causes = append(causes, "this process has CAP_BPF or CAP_SYS_ADMIN and no seccomp filter, so a Linux security module (SELinux, AppArmor) refused it")
	}
	return "bpf(2) refused: " + strings.Join(causes, "; ")
}

// bpfMap is the bpf backend.
type bpfMap struct {
	m    *ebpf.Map
	path string
	// lock keeps other agents off the pin while the map is open.
	lock *mapLock
	// noBatch is set once the kernel refused a batch syscall, so later
	// calls go straight to single-element syscalls.
	noBatch atomic.Bool
	closed  atomic.Bool
}

func (b *bpfMap) Kind() Kind   { return KindBPF }
func (b *bpfMap) Path() string { return b.path }

func (b *bpfMap) Lookup(k Key) (Value, bool, error) {
	var (
		rk rawKey
		rv rawValue
		v  Value
	)
	if b.closed.Load() {
		return v, false, ErrClosed
	}
	if err := k.put(&rk); err != nil {
		return v, false, err
	}
	// The kernel's lookup is the longest-prefix match that the datapath
	// does, so this needs no user-space trie.
	err := b.m.Lookup(unsafe.Pointer(&rk), unsafe.Pointer(&rv))
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return v, false, nil
	}
	if err != nil {
		return v, false, fmt.Errorf("lookup %s: %w", k, err)
	}
	v.get(&rv)
	return v, true, nil
}

func (b *bpfMap) Update(k Key, v Value) error {
	var (
		rk rawKey
		rv rawValue
	)
	if b.closed.Load() {
		return ErrClosed
	}
	if err := k.put(&rk); err != nil {
		return err
	}
	if err := v.put(&rv); err != nil {
		return err
	}
	if err := b.m.Update(unsafe.Pointer(&rk), unsafe.Pointer(&rv), ebpf.UpdateAny); err != nil {
		return fmt.Errorf("update %s: %w", k, wrapFull(err))
	}
	return nil
}

func (b *bpfMap) Delete(k Key) error {
	var rk rawKey
	if b.closed.Load() {
		return ErrClosed
	}
	if err := k.put(&rk); err != nil {
		return err
	}
	err := b.m.Delete(unsafe.Pointer(&rk))
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("delete %s: %w", k, err)
	}
	return nil
}

// wrapFull makes a full trie recognizable: the LPM trie reports ENOSPC.
func wrapFull(err error) error {
	if errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.E2BIG) {
		return fmt.Errorf("%w: %w", ErrFull, err)
	}
	return err
}

// batchUnsupported reports whether err means the kernel lacks batch
// operations for this map type (rather than a failed element).
func batchUnsupported(err error) bool {
	return errors.Is(err, ebpf.ErrNotSupported) || errors.Is(err, unix.EINVAL) ||
		errors.Is(err, unix.ENOTSUP) || errors.Is(err, unix.EOPNOTSUPP)
}

func (b *bpfMap) UpdateBatch(entries []Entry) error {
	if b.closed.Load() {
		return ErrClosed
	}
	n := min(len(entries), batchSize)
	keys := make([]rawKey, n)
	vals := make([]rawValue, n)
	for len(entries) > 0 {
		chunk := entries[:min(len(entries), batchSize)]
		entries = entries[len(chunk):]
		keys, vals = keys[:len(chunk)], vals[:len(chunk)]
		for i := range chunk {
			if err := chunk[i].Key.put(&keys[i]); err != nil {
				return err
			}
			if err := chunk[i].Value.put(&vals[i]); err != nil {
				return fmt.Errorf("%s: %w", chunk[i].Key, err)
			}
		}
		if err := b.updateRaw(keys, vals); err != nil {
			return err
		}
	}
	return nil
}

func (b *bpfMap) updateRaw(keys []rawKey, vals []rawValue) error {
	if !b.noBatch.Load() {
		done, err := b.m.BatchUpdate(keys, vals, &ebpf.BatchOptions{ElemFlags: uint64(ebpf.UpdateAny)})
		if err == nil {
			return nil
		}
		if done > 0 || !batchUnsupported(err) {
			return fmt.Errorf("batch update: %w", wrapFull(err))
		}
		b.noBatch.Store(true)
	}
	for i := range keys {
		if err := b.m.Update(unsafe.Pointer(&keys[i]), unsafe.Pointer(&vals[i]), ebpf.UpdateAny); err != nil {
			var k Key
			_ = k.get(&keys[i])
			return fmt.Errorf("update %s: %w", k, wrapFull(err))
		}
	}
	return nil
}

func (b *bpfMap) DeleteBatch(keys []Key) error {
	if b.closed.Load() {
		return ErrClosed
	}
	raw := make([]rawKey, min(len(keys), batchSize))
	for len(keys) > 0 {
		chunk := keys[:min(len(keys), batchSize)]
		keys = keys[len(chunk):]
		raw = raw[:len(chunk)]
		for i := range chunk {
			if err := chunk[i].put(&raw[i]); err != nil {
				return err
			}
		}
		if err := b.deleteRaw(raw); err != nil {
			return err
		}
	}
	return nil
}

func (b *bpfMap) deleteRaw(keys []rawKey) error {
	for len(keys) > 0 && !b.noBatch.Load() {
		done, err := b.m.BatchDelete(keys, nil)
		if err == nil {
			return nil
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) && done < len(keys) {
			// The kernel stops at the first missing key, having deleted
			// the ones before it; skip it and go on.
			keys = keys[done+1:]
			continue
		}
		if done > 0 || !batchUnsupported(err) {
			return fmt.Errorf("batch delete: %w", err)
		}
		b.noBatch.Store(true)
	}
	for i := range keys {
		err := b.m.Delete(unsafe.Pointer(&keys[i]))
		if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("delete: %w", err)
		}
	}
	return nil
}

// walk calls fn with the raw contents of the map, a chunk at a time, using
// batch lookups when the kernel has them and NextKey iteration otherwise.
func (b *bpfMap) walk(fn func(keys []rawKey, vals []rawValue) bool) error {
	keys := make([]rawKey, batchSize)
	vals := make([]rawValue, batchSize)
	if !b.noBatch.Load() {
		var cursor ebpf.MapBatchCursor
		first := true
		for {
			n, err := b.m.BatchLookup(&cursor, keys, vals, nil)
			if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
				if first && batchUnsupported(err) {
					b.noBatch.Store(true)
					break
				}
				return fmt.Errorf("batch lookup: %w", err)
			}
			first = false
			if n > 0 && !fn(keys[:n], vals[:n]) {
				return nil
			}
			if err != nil { // ErrKeyNotExist: no more entries.
				return nil
			}
		}
	}

	// NextKey iteration, chunked like the batch path.
	n := 0
	var (
		cur     rawKey
		started bool
	)
	for {
		var err error
		if !started {
			err = b.m.NextKey(nil, unsafe.Pointer(&keys[n]))
			started = true
		} else {
			err = b.m.NextKey(unsafe.Pointer(&cur), unsafe.Pointer(&keys[n]))
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			break
		}
		if err != nil {
			return fmt.Errorf("next key: %w", err)
		}
		cur = keys[n]
		err = b.m.Lookup(unsafe.Pointer(&keys[n]), unsafe.Pointer(&vals[n]))
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			continue // deleted meanwhile
		}
		if err != nil {
			return fmt.Errorf("lookup: %w", err)
		}
		n++
		if n == len(keys) {
			if !fn(keys, vals) {
				return nil
			}
			n = 0
		}
	}
	if n > 0 {
		fn(keys[:n], vals[:n])
	}
	return nil
}

func (b *bpfMap) Dump(yield func(Key, Value) bool) error {
	if b.closed.Load() {
		return ErrClosed
	}
	return b.walk(func(keys []rawKey, vals []rawValue) bool {
		for i := range keys {
			e, err := decodeEntry(&keys[i], &vals[i])
			if err != nil {
				continue
			}
			if !yield(e.Key, e.Value) {
				return false
			}
		}
		return true
	})
}

// snapshot reads all decodable entries in one pass. The kernel does not say
// how many entries an LPM trie holds, so the raw records (36 bytes each) are
// gathered first and decoded into a slice of the exact size: appending to a
// growing []Entry would copy 80-byte entries over and over (about 5x the
// final size in allocations for 100k entries).
func (b *bpfMap) snapshot() ([]Entry, int, error) {
	type chunk struct {
		keys []rawKey
		vals []rawValue
	}
	var (
		chunks []chunk
		total  int
	)
	err := b.walk(func(keys []rawKey, vals []rawValue) bool {
		chunks = append(chunks, chunk{slices.Clone(keys), slices.Clone(vals)})
		total += len(keys)
		return true
	})
	if err != nil {
		return nil, 0, err
	}
	out := make([]Entry, 0, total)
	skipped := 0
	for _, c := range chunks {
		for i := range c.keys {
			e, err := decodeEntry(&c.keys[i], &c.vals[i])
			if err != nil {
				skipped++
				continue
			}
			out = append(out, e)
		}
	}
	return out, skipped, nil
}

func (b *bpfMap) Len() (int, error) {
	if b.closed.Load() {
		return 0, ErrClosed
	}
	n := 0
	err := b.walk(func(keys []rawKey, _ []rawValue) bool {
		n += len(keys)
		return true
	})
	return n, err
}

func (b *bpfMap) Sync() error {
	if b.closed.Load() {
		return ErrClosed
	}
	return nil
}

func (b *bpfMap) SyncKeys([]Key) error { return b.Sync() }

func (b *bpfMap) Compact() error { return b.Sync() }

func (b *bpfMap) Close() error {
	if b.closed.Swap(true) {
		return nil
	}
	return errors.Join(b.m.Close(), b.lock.release())
}
