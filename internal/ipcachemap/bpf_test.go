//go:build linux

package ipcachemap

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

var (
	bpfProbeOnce sync.Once
	bpfProbeErr  error
)

// requireBPF skips the test, saying why, unless this process can create
// and pin BPF LPM tries.
func requireBPF(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("bpf backend tests need root (CAP_BPF and CAP_SYS_ADMIN to mount bpffs)")
	}
	bpfProbeOnce.Do(func() {
		if _, err := ensureBPFFS(DefaultBPFFSRoot, DefaultBPFFSRoot); err != nil {
			bpfProbeErr = err
			return
		}
		m, err := ebpf.NewMap(bpfSpec(1))
		if err != nil {
			bpfProbeErr = err
			return
		}
		m.Close()
	})
	if bpfProbeErr != nil {
		t.Skipf("kernel refuses BPF LPM tries here: %v", bpfProbeErr)
	}
}

// testPinPath returns a unique pin path under /sys/fs/bpf that is removed
// when the test ends.
func testPinPath(t testing.TB) string {
	t.Helper()
	dir := filepath.Join(DefaultBPFFSRoot, "identityd-test-"+randomSuffix())
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "ipcache")
}

func openTestBPF(t testing.TB, cfg Config) (Map, OpenInfo) {
	t.Helper()
	requireBPF(t)
	cfg.Kind = KindBPF
	if cfg.PinPath == "" {
		cfg.PinPath = testPinPath(t)
	}
	m, info, err := Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m, info
}

func disableBatch(m Map) { m.(*bpfMap).noBatch.Store(true) }

func TestBPFCreateAndReuse(t *testing.T) {
	pin := testPinPath(t)
	m, info := openTestBPF(t, Config{PinPath: pin, MaxEntries: 1000})
	if !info.Created || info.Kind != KindBPF || m.Kind() != KindBPF || m.Path() != pin {
		t.Fatalf("first open: %+v", info)
	}
	raw, err := ebpf.LoadPinnedMap(pin, nil)
	if err != nil {
		t.Fatalf("map not pinned: %v", err)
	}
	if raw.Type() != ebpf.LPMTrie || raw.KeySize() != 24 || raw.ValueSize() != 12 ||
		raw.MaxEntries() != 1000 || raw.Flags() != unix.BPF_F_NO_PREALLOC {
		t.Fatalf("pinned map layout: %v flags %#x", raw, raw.Flags())
	}
	raw.Close()

	entries := testEntries(50)
	if err := m.UpdateBatch(entries); err != nil {
		t.Fatal(err)
	}
	m.Close()

	m2, info2 := openTestBPF(t, Config{PinPath: pin, MaxEntries: 1000})
	if info2.Created || info2.Replaced != "" || !strings.Contains(info2.Reason, "reusing") {
		t.Fatalf("reopen: %+v", info2)
	}
	equalEntries(t, info2.Snapshot, entries)
	if n, _ := m2.Len(); n != 50 {
		t.Fatalf("Len after reopen = %d", n)
	}
}

// TestBPFReopenInNewProcess checks the pin outlives its creator: a child
// process opens it and prints the kernel's raw bytes.
func TestBPFReopenInNewProcess(t *testing.T) {
	pin := testPinPath(t)
	m, _ := openTestBPF(t, Config{PinPath: pin, MaxEntries: 1000})
	entries := testEntries(200)
	if err := m.UpdateBatch(entries); err != nil {
		t.Fatal(err)
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}

	var want []string
	for _, e := range entries {
		k, _ := e.Key.MarshalBinary()
		v, _ := e.Value.MarshalBinary()
		want = append(want, "raw "+hex.EncodeToString(k)+" "+hex.EncodeToString(v))
	}
	for _, e := range entries {
		want = append(want, fmt.Sprintf("entry %s %+v", e.Key, e.Value))
	}

	cmd := childCommand(t, "bpf-dump", pin)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, stderr.String())
	}
	var got []string
	var reason string
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		if r, ok := strings.CutPrefix(sc.Text(), "reason "); ok {
			reason = r
			continue
		}
		got = append(got, sc.Text())
	}
	if !strings.Contains(reason, "reusing") {
		t.Errorf("child did not reuse the pinned map: %q", reason)
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("child read back %d lines, want %d; first got %q, first want %q", len(got), len(want), first(got), first(want))
	}
}

func first(s []string) string {
	if len(s) == 0 {
		return ""
	}
	return s[0]
}

// childBPFDump opens the pinned map at pin like the agent would and prints
// the raw records (read straight from the kernel) and the decoded snapshot.
func childBPFDump(pin string) int {
	m, info, err := Open(Config{Kind: KindBPF, PinPath: pin, MaxEntries: 1000})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer m.Close()
	fmt.Printf("reason %s\n", info.Reason)
	raw, err := ebpf.LoadPinnedMap(pin, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer raw.Close()
	var k, v []byte
	it := raw.Iterate()
	for it.Next(&k, &v) {
		fmt.Printf("raw %x %x\n", k, v)
	}
	if err := it.Err(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	for _, e := range info.Snapshot {
		fmt.Printf("entry %s %+v\n", e.Key, e.Value)
	}
	return 0
}

func TestBPFReplaceDifferentLayout(t *testing.T) {
	requireBPF(t)
	t.Run("other max entries", func(t *testing.T) {
		pin := testPinPath(t)
		old, _ := openTestBPF(t, Config{PinPath: pin, MaxEntries: 100})
		entries := testEntries(30)
		if err := old.UpdateBatch(entries); err != nil {
			t.Fatal(err)
		}
		old.Close()

		m, info := openTestBPF(t, Config{PinPath: pin, MaxEntries: 200})
		if !strings.Contains(info.Replaced, "max entries 100, want 200") {
			t.Fatalf("Replaced = %q", info.Replaced)
		}
		equalEntries(t, info.Snapshot, entries)
		// The old map is kept pinned aside, whole, not destroyed.
		kept := keptAside(t, pin, info)
		if kept.MaxEntries() != 100 {
			t.Fatalf("kept map has max entries %d", kept.MaxEntries())
		}
		if n := countRaw(t, kept); n != 30 {
			t.Fatalf("kept map holds %d entries, want 30", n)
		}
		if n, _ := m.Len(); n != 0 {
			t.Fatalf("replacement map has %d entries, want an empty map", n)
		}
		raw, err := ebpf.LoadPinnedMap(pin, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer raw.Close()
		if raw.MaxEntries() != 200 {
			t.Fatalf("pinned map has max entries %d", raw.MaxEntries())
		}
	})
	t.Run("other type and sizes", func(t *testing.T) {
		pin := testPinPath(t)
		if err := os.MkdirAll(filepath.Dir(pin), 0o700); err != nil {
			t.Fatal(err)
		}
		h, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 8, ValueSize: 8, MaxEntries: 4})
		if err != nil {
			t.Fatal(err)
		}
		if err := h.Put(uint64(1), uint64(2)); err != nil {
			t.Fatal(err)
		}
		if err := h.Pin(pin); err != nil {
			t.Fatal(err)
		}
		h.Close()

		m1, info := openTestBPF(t, Config{PinPath: pin, MaxEntries: 100})
		m1.Close()
		if !strings.Contains(info.Replaced, "type Hash, want LPMTrie") || !strings.Contains(info.Replaced, "key size 8, want 24") {
			t.Fatalf("Replaced = %q", info.Replaced)
		}
		// One warning that its entries are not restored, one that says
		// where it is kept.
		if len(info.Snapshot) != 0 || len(info.Warnings) != 2 || !strings.Contains(info.Warnings[1], info.MovedAside) {
			t.Fatalf("snapshot %v warnings %q", info.Snapshot, info.Warnings)
		}
		kept := keptAside(t, pin, info)
		var v uint64
		if kept.Type() != ebpf.Hash || kept.Lookup(uint64(1), &v) != nil || v != 2 {
			t.Fatalf("kept map %v lost its entry (%d)", kept, v)
		}
		// A second replacement keeps the first one kept aside too.
		h2, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 8, ValueSize: 8, MaxEntries: 4})
		if err != nil {
			t.Fatal(err)
		}
		os.Remove(pin)
		if err := h2.Pin(pin); err != nil {
			t.Fatal(err)
		}
		h2.Close()
		_, info2 := openTestBPF(t, Config{PinPath: pin, MaxEntries: 100})
		if info2.MovedAside == "" || info2.MovedAside == info.MovedAside {
			t.Fatalf("second replacement kept at %q, first at %q", info2.MovedAside, info.MovedAside)
		}
		keptAside(t, pin, info)
		raw, err := ebpf.LoadPinnedMap(pin, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer raw.Close()
		if raw.Type() != ebpf.LPMTrie {
			t.Fatalf("pin still holds %v", raw)
		}
	})
	t.Run("same sizes, hash type", func(t *testing.T) {
		// A same-sized map of another type is still read for restoration.
		pin := testPinPath(t)
		os.MkdirAll(filepath.Dir(pin), 0o700)
		h, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: KeySize, ValueSize: ValueSize, MaxEntries: 8})
		if err != nil {
			t.Fatal(err)
		}
		e := testEntries(1)[0]
		k, _ := e.Key.MarshalBinary()
		v, _ := e.Value.MarshalBinary()
		if err := h.Put(k, v); err != nil {
			t.Fatal(err)
		}
		bad := make([]byte, KeySize) // family 0: not decodable
		if err := h.Put(bad, make([]byte, ValueSize)); err != nil {
			t.Fatal(err)
		}
		if err := h.Pin(pin); err != nil {
			t.Fatal(err)
		}
		h.Close()
		_, info := openTestBPF(t, Config{PinPath: pin, MaxEntries: 100})
		if info.Replaced == "" || info.Skipped != 1 {
			t.Fatalf("info %+v", info)
		}
		equalEntries(t, info.Snapshot, []Entry{e})
	})
}

// keptAside opens the map that replacing the one at pin kept aside.
func keptAside(t *testing.T, pin string, info OpenInfo) *ebpf.Map {
	t.Helper()
	if !strings.HasPrefix(info.MovedAside, pin+incompatibleSuffix) {
		t.Fatalf("incompatible map moved to %q", info.MovedAside)
	}
	kept, err := ebpf.LoadPinnedMap(info.MovedAside, nil)
	if err != nil {
		t.Fatalf("incompatible map not kept: %v", err)
	}
	t.Cleanup(func() { kept.Close() })
	return kept
}

func countRaw(t *testing.T, m *ebpf.Map) int {
	t.Helper()
	var k, v []byte
	n := 0
	it := m.Iterate()
	for it.Next(&k, &v) {
		n++
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestBPFSecondOpenRefused opens one pin twice, in this process and from a
// child process: the second open must fail with ErrInUse, naming the pin
// and this process as the holder, without touching the entries; once the
// first closes, the pin opens again.
func TestBPFSecondOpenRefused(t *testing.T) {
	pin := testPinPath(t)
	m, _ := openTestBPF(t, Config{PinPath: pin, MaxEntries: 1000})
	entries := testEntries(100)
	if err := m.UpdateBatch(entries); err != nil {
		t.Fatal(err)
	}
	testSecondOpenRefused(t, m, "bpf-open", Config{Kind: KindBPF, PinPath: pin, MaxEntries: 1000})
	testSecondOpenRefused(t, m, "bpf-open", Config{Kind: KindAuto, PinPath: pin, FilePath: tempFilePath(t), MaxEntries: 1000})
	got, err := Snapshot(m)
	if err != nil {
		t.Fatal(err)
	}
	equalEntries(t, got, entries)
	m.Close()
	m2, info := openTestBPF(t, Config{PinPath: pin, MaxEntries: 1000})
	equalEntries(t, info.Snapshot, entries)
	m2.Close()
}

// TestBPFNotAMapAtPin puts a directory where the map is pinned: Open
// refuses with an error naming the pin and leaves the directory alone.
func TestBPFNotAMapAtPin(t *testing.T) {
	requireBPF(t)
	pin := testPinPath(t)
	if err := os.MkdirAll(filepath.Join(pin, "inside"), 0o700); err != nil {
		t.Fatal(err)
	}
	_, _, err := Open(Config{Kind: KindBPF, PinPath: pin, MaxEntries: 10})
	if err == nil || !strings.Contains(err.Error(), "cannot open pinned map "+pin) {
		t.Fatalf("Open with a directory at the pin: %v", err)
	}
	if _, err := os.Stat(filepath.Join(pin, "inside")); err != nil {
		t.Fatalf("directory at the pin touched: %v", err)
	}
	// The refused open left the lock free.
	if err := os.RemoveAll(pin); err != nil {
		t.Fatal(err)
	}
	m, _ := openTestBPF(t, Config{PinPath: pin, MaxEntries: 10})
	m.Close()
}

// TestBPFMountsBPFFS lets Open mount a bpffs where none is, and checks that
// it says so (the agent logs it).
func TestBPFMountsBPFFS(t *testing.T) {
	requireBPF(t)
	root := filepath.Join(t.TempDir(), "bpffs")
	pin := filepath.Join(root, "identityd", "ipcache")
	m, info, err := Open(Config{Kind: KindBPF, PinPath: pin, BPFFSRoot: root, MaxEntries: 10})
	t.Cleanup(func() { unix.Unmount(root, unix.MNT_DETACH) })
	if err != nil {
		t.Fatal(err)
	}
	m.Close()
	if info.MountedBPFFS != root {
		t.Fatalf("MountedBPFFS = %q, want %q", info.MountedBPFFS, root)
	}
	m, info, err = Open(Config{Kind: KindBPF, PinPath: pin, BPFFSRoot: root, MaxEntries: 10})
	if err != nil {
		t.Fatal(err)
	}
	m.Close()
	if info.MountedBPFFS != "" {
		t.Fatalf("second open mounted again at %q", info.MountedBPFFS)
	}
}

func TestAutoPicksBPF(t *testing.T) {
	requireBPF(t)
	pin := testPinPath(t)
	m, info, err := Open(Config{PinPath: pin, FilePath: tempFilePath(t), MaxEntries: 10})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if m.Kind() != KindBPF || !strings.HasPrefix(info.Reason, "auto: created") {
		t.Fatalf("auto chose %s: %s", m.Kind(), info.Reason)
	}
}

func TestAutoFallsBackToFile(t *testing.T) {
	// A pin directory that is neither on bpffs nor below the bpffs root
	// cannot hold a pin, whatever the privileges.
	dir := t.TempDir()
	file := filepath.Join(dir, FileName)
	m, info, err := Open(Config{PinPath: filepath.Join(dir, "pins", "ipcache"), BPFFSRoot: filepath.Join(dir, "bpffs"), FilePath: file})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if m.Kind() != KindFile || m.Path() != file {
		t.Fatalf("auto chose %s at %s", m.Kind(), m.Path())
	}
	if !strings.Contains(info.Reason, "bpf backend unavailable") || !strings.Contains(info.Reason, "not on a bpffs") {
		t.Fatalf("reason %q does not say why", info.Reason)
	}
}

// memlock returns the kernel's memory accounting of a bpf map.
func memlock(m Map) (uint64, bool) {
	b, ok := m.(*bpfMap)
	if !ok {
		return 0, false
	}
	info, err := b.m.Info()
	if err != nil {
		return 0, false
	}
	return info.Memlock()
}

// TestBPFSymlinkedPinRefused: a pin path that is a bpffs symlink to
// another agent's pin opens the same map, so it is refused as the same
// path is, naming the holder, in this process and in another one; the
// first agent's entries stay as they were.
func TestBPFSymlinkedPinRefused(t *testing.T) {
	pin := testPinPath(t)
	m, _ := openTestBPF(t, Config{PinPath: pin, MaxEntries: 1000})
	entries := testEntries(3)
	if err := m.UpdateBatch(entries); err != nil {
		t.Fatal(err)
	}
	other := testPinPath(t)
	if err := os.MkdirAll(filepath.Dir(other), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(pin, other); err != nil {
		t.Fatal(err)
	}
	_, _, err := Open(Config{Kind: KindBPF, PinPath: other, MaxEntries: 1000})
	if !errors.Is(err, ErrInUse) {
		t.Fatalf("open through a symlink to a held pin: %v, want ErrInUse", err)
	}
	for _, want := range []string{other, "a symlink to " + pin, fmt.Sprintf("pid %d", os.Getpid())} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %q", err, want)
		}
	}
	out, err := childCommand(t, "bpf-open", other).CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 3 || !strings.Contains(string(out), fmt.Sprintf("pid %d", os.Getpid())) {
		t.Fatalf("another process's open through the symlink: %v\n%s", err, out)
	}
	got, err := Snapshot(m)
	if err != nil {
		t.Fatal(err)
	}
	equalEntries(t, got, entries)
}
