package ipcachemap

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io/fs"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

func openTestFile(t testing.TB, path string) (Map, OpenInfo) {
	t.Helper()
	m, info, err := Open(Config{Kind: KindFile, FilePath: path, MaxEntries: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m, info
}

// TestFileSecondOpenRefused is TestBPFSecondOpenRefused for the map file.
func TestFileSecondOpenRefused(t *testing.T) {
	path := tempFilePath(t)
	m, _ := openTestFile(t, path)
	entries := testEntries(100)
	if err := m.UpdateBatch(entries); err != nil {
		t.Fatal(err)
	}
	if err := m.Sync(); err != nil {
		t.Fatal(err)
	}
	testSecondOpenRefused(t, m, "file-open", Config{Kind: KindFile, FilePath: path, MaxEntries: 1000})
	got, err := Snapshot(m)
	if err != nil {
		t.Fatal(err)
	}
	equalEntries(t, got, entries)
	m.Close()
	_, info := openTestFile(t, path)
	equalEntries(t, info.Snapshot, entries)
}

// TestFileNotRegular puts a directory and a FIFO where the map file
// belongs: each is moved aside, as the checkpoint loader does, and the map
// starts empty instead of keeping the agent from starting (or blocking on
// the FIFO).
func TestFileNotRegular(t *testing.T) {
	for name, mk := range map[string]func(string) error{
		"directory": func(p string) error {
			if err := os.Mkdir(p, 0o700); err != nil {
				return err
			}
			return os.WriteFile(filepath.Join(p, "inside"), []byte("kept"), 0o600)
		},
		"fifo": func(p string) error { return syscall.Mkfifo(p, 0o600) },
	} {
		t.Run(name, func(t *testing.T) {
			path := tempFilePath(t)
			if err := mk(path); err != nil {
				t.Fatal(err)
			}
			m, info := openTestFile(t, path)
			if !strings.HasPrefix(filepath.Base(info.MovedAside), FileName+".corrupt-") ||
				len(info.Warnings) != 1 || !strings.Contains(info.Warnings[0], "not a regular file") {
				t.Fatalf("open info %+v", info)
			}
			if name == "directory" {
				if b, err := os.ReadFile(filepath.Join(info.MovedAside, "inside")); err != nil || string(b) != "kept" {
					t.Fatalf("directory not kept whole: %q %v", b, err)
				}
			}
			m.Update(testEntries(1)[0].Key, testEntries(1)[0].Value)
			if err := m.Close(); err != nil {
				t.Fatal(err)
			}
			if got, err := ReadFile(path); err != nil || len(got) != 1 {
				t.Fatalf("map file after replacing the %s: %v %v", name, got, err)
			}
		})
	}
}

// testSecondOpenRefused opens cfg again while first holds it, here and
// in a child process.
func testSecondOpenRefused(t *testing.T, first Map, childMode string, cfg Config) {
	t.Helper()
	_, _, err := Open(cfg)
	if !errors.Is(err, ErrInUse) {
		t.Fatalf("second open of %s: %v, want ErrInUse", first.Path(), err)
	}
	for _, want := range []string{first.Path(), fmt.Sprintf("pid %d", os.Getpid()), "this process"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %q", err, want)
		}
	}
	if cfg.Kind == KindAuto {
		return // the child opens with the backend's own kind
	}
	cmd := childCommand(t, childMode, first.Path())
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 3 {
		t.Fatalf("child open: %v\n%s", err, out)
	}
	for _, want := range []string{first.Path(), fmt.Sprintf("pid %d", os.Getpid())} {
		if !strings.Contains(string(out), want) {
			t.Errorf("child's error %q does not name %q", out, want)
		}
	}
}

// childOpen opens the map at path as an agent would and exits 3 when it is
// refused as in use, 0 when it opened.
func childOpen(mode, path string) int {
	cfg := Config{Kind: KindBPF, PinPath: path, MaxEntries: 1000}
	if mode == "file-open" {
		cfg = Config{Kind: KindFile, FilePath: path, MaxEntries: 1000}
	}
	m, _, err := Open(cfg)
	if err != nil {
		fmt.Println(err)
		if errors.Is(err, ErrInUse) {
			return 3
		}
		return 1
	}
	m.Close()
	return 0
}

func TestFilePersistence(t *testing.T) {
	path := tempFilePath(t)
	m, info := openTestFile(t, path)
	if !info.Created || info.Kind != KindFile {
		t.Fatalf("first open: %+v", info)
	}
	entries := testEntries(1000)
	if err := m.UpdateBatch(entries); err != nil {
		t.Fatal(err)
	}
	// Nothing is written until Sync: writes stay cheap.
	if _, err := os.Stat(path); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("file written before Sync: %v", err)
	}
	if err := m.Sync(); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("file mode %v, want 0600", fi.Mode().Perm())
	}
	if fi.Size() != headerSize+1000*recordSize {
		t.Errorf("file size %d", fi.Size())
	}
	// A Sync without changes does not rewrite the file.
	mtime := fi.ModTime()
	time.Sleep(10 * time.Millisecond)
	if err := m.Sync(); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(path); !fi.ModTime().Equal(mtime) {
		t.Errorf("clean Sync rewrote the file")
	}
	// An unchanged update does not dirty it either.
	if err := m.Update(entries[0].Key, entries[0].Value); err != nil {
		t.Fatal(err)
	}
	if m.(*fileMap).dirty {
		t.Errorf("unchanged update marked the map dirty")
	}

	// Close persists the last changes.
	if err := m.Delete(entries[0].Key); err != nil {
		t.Fatal(err)
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	m2, info2 := openTestFile(t, path)
	if info2.Created || !strings.Contains(info2.Reason, "999 entries") {
		t.Fatalf("reopen: %+v", info2)
	}
	equalEntries(t, info2.Snapshot, entries[1:])
	got, err := ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	equalEntries(t, got, entries[1:])
	if n, _ := m2.Len(); n != 999 {
		t.Fatalf("Len = %d", n)
	}
}

// TestFileRecordLayout checks the file holds the map's exact record bytes.
func TestFileRecordLayout(t *testing.T) {
	requireLittleEndian(t)
	path := tempFilePath(t)
	m, _ := openTestFile(t, path)
	k := Key{Prefix: pfx("10.0.0.0/8"), ClusterID: 5}
	v := Value{Identity: 16777217, TunnelEndpoint: netip.MustParseAddr("192.168.0.1"), EncryptKey: 3, Flags: 1}
	if err := m.Update(k, v); err != nil {
		t.Fatal(err)
	}
	if err := m.Sync(); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	want := unhex(t, `
		69646970636d6170 | 01000000 | 1800 | 0c00 | 01 000000 | 0100000000000000`)
	if !bytes.Equal(data[:28], want) {
		t.Fatalf("header\n got %x\nwant %x", data[:28], want)
	}
	rec := unhex(t, `28000000 0500 00 01 0a000000 000000000000000000000000 | 01000001 c0a80001 0000 03 01`)
	if !bytes.Equal(data[headerSize:], rec) {
		t.Fatalf("record\n got %x\nwant %x", data[headerSize:], rec)
	}
}

func TestFileCorrupt(t *testing.T) {
	// A valid file to damage.
	dir := t.TempDir()
	good := filepath.Join(dir, "good")
	m, _ := openTestFile(t, good)
	m.UpdateBatch(testEntries(10))
	m.Close()
	valid, err := os.ReadFile(good)
	if err != nil {
		t.Fatal(err)
	}
	flip := func(off int) []byte {
		b := bytes.Clone(valid)
		b[off] ^= 0x40
		return b
	}
	withHeader := func(mod func(b []byte)) []byte {
		b := bytes.Clone(valid)
		mod(b)
		crc := crc32.Update(crc32.Checksum(b[0:28], castagnoli), castagnoli, b[headerSize:])
		binary.LittleEndian.PutUint32(b[28:32], crc)
		return b
	}
	for _, tc := range []struct {
		name string
		data []byte
		want string
	}{
		{"empty", nil, "shorter than the 32-byte header"},
		{"truncated header", valid[:20], "shorter than the 32-byte header"},
		{"truncated records", valid[:len(valid)-5], "header says 10 records"},
		{"extra bytes", append(bytes.Clone(valid), 0), "header says 10 records"},
		{"bad magic", flip(0), "bad magic"},
		{"flipped record bit", flip(headerSize + 40), "checksum"},
		{"flipped count", flip(20), "header says"},
		{"flipped crc", flip(29), "checksum"},
		{"newer version", withHeader(func(b []byte) { b[8] = 2 }), "unsupported format version 2"},
		{"other sizes", withHeader(func(b []byte) { b[14] = 24 }), "key/value sizes 24/24"},
		{"other byte order", withHeader(func(b []byte) { b[16] = 3 - nativeOrder() }), "byte order"},
		{"bad family in record", withHeader(func(b []byte) { b[headerSize+7] = 9 }), "unknown address family 9"},
		{"duplicate record", withHeader(func(b []byte) { copy(b[headerSize+recordSize:], b[headerSize:headerSize+KeySize]) }), "duplicate key"},
		{"host bits set", withHeader(func(b []byte) { b[headerSize+23] = 1 }), "not in canonical form"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, FileName)
			if err := os.WriteFile(path, tc.data, 0o600); err != nil {
				t.Fatal(err)
			}
			_, err := ReadFile(path)
			if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("ReadFile: %v, want ErrCorrupt containing %q", err, tc.want)
			}
			m, info := openTestFile(t, path)
			if info.MovedAside == "" || len(info.Warnings) != 1 || !strings.Contains(info.Warnings[0], tc.want) {
				t.Fatalf("open info %+v", info)
			}
			if !strings.HasPrefix(filepath.Base(info.MovedAside), FileName+".corrupt-") {
				t.Fatalf("moved to %s", info.MovedAside)
			}
			aside, err := os.ReadFile(info.MovedAside)
			if err != nil || !bytes.Equal(aside, tc.data) {
				t.Fatalf("corrupt file not preserved: %v", err)
			}
			if n, _ := m.Len(); n != 0 {
				t.Fatalf("map after corrupt file has %d entries", n)
			}
			// The next open of an equally corrupt file keeps both.
			m.Close()
			os.WriteFile(path, tc.data, 0o600)
			_, info2 := openTestFile(t, path)
			if info2.MovedAside == info.MovedAside {
				t.Fatalf("second corrupt file overwrote the first at %s", info.MovedAside)
			}
		})
	}
}

func TestFileWriteBehind(t *testing.T) {
	path := tempFilePath(t)
	m, _, err := Open(Config{Kind: KindFile, FilePath: path, SyncDelay: 5 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	entries := testEntries(5)
	if err := m.UpdateBatch(entries); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		got, err := ReadFile(path)
		if err == nil && len(got) == len(entries) {
			equalEntries(t, got, entries)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("write-behind did not persist within 5s: %v", err)
		}
		time.Sleep(5 * time.Millisecond)
	}
	// Changes right before Close are not lost to a pending timer.
	m.Delete(entries[0].Key)
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	got, err := ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	equalEntries(t, got, entries[1:])
}

// crashState is the table a crash-test writer holds at generation g: the
// entry count and the identity both depend on g, so any mix of two
// generations is detectable.
func crashState(g int) []Entry {
	n := 50 + g%50
	out := make([]Entry, n)
	for i := range n {
		out[i] = Entry{
			Key:   Key{Prefix: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i), 0, 0}), 16)},
			Value: Value{Identity: identityNum(0x01000000 + g)},
		}
	}
	return out
}

// childFileWriter writes crash states in a loop until killed, continuing
// from the generation found in the file.
func childFileWriter(path string) int {
	m, info, err := Open(Config{Kind: KindFile, FilePath: path})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	g := 0
	if len(info.Snapshot) > 0 {
		g = int(info.Snapshot[0].Value.Identity - 0x01000000)
	}
	for {
		g++
		state := crashState(g)
		var gone []Key
		for i := len(state); i < 100; i++ {
			gone = append(gone, Key{Prefix: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i), 0, 0}), 16)})
		}
		if err := m.UpdateBatch(state); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		if err := m.DeleteBatch(gone); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		if err := m.Sync(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
}

// TestFileCrashSafety SIGKILLs a writer at random moments: every time, the
// file must load and hold exactly one generation's state, and temp files
// must not pile up.
func TestFileCrashSafety(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns 100 processes")
	}
	path := tempFilePath(t)
	dir := filepath.Dir(path)
	lastGen, progressed := 0, 0
	for i := range 100 {
		cmd := childCommand(t, "file-writer", path)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		if i%2 == 0 {
			// Every other kill waits for the writer to get past the
			// last generation first, so that progress shows however
			// slowly a loaded machine starts processes.
			waitForGeneration(t, path, lastGen)
		}
		time.Sleep(time.Duration(5+rand.IntN(40)) * time.Millisecond)
		if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		err := cmd.Wait()
		if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() {
			t.Fatalf("kill %d: child exited by itself: %v\n%s", i, err, stderr.String())
		}

		got, err := ReadFile(path)
		if errors.Is(err, fs.ErrNotExist) && lastGen == 0 {
			continue // killed before the first write
		}
		if err != nil {
			t.Fatalf("kill %d: file does not load: %v", i, err)
		}
		if len(got) == 0 {
			t.Fatalf("kill %d: empty file", i)
		}
		g := int(got[0].Value.Identity - 0x01000000)
		equalEntries(t, got, crashState(g))
		if g < lastGen {
			t.Fatalf("kill %d: generation went back from %d to %d", i, lastGen, g)
		}
		if g > lastGen {
			progressed++
		}
		lastGen = g

		names, _ := filepath.Glob(filepath.Join(dir, "*"))
		for _, n := range names {
			if n != path && n != path+tmpSuffix && n != path+FileLockSuffix {
				t.Fatalf("kill %d: unexpected file %s", i, n)
			}
		}
	}
	if progressed < 50 {
		t.Errorf("writer made progress in only %d of 100 runs (last generation %d)", progressed, lastGen)
	}
	t.Logf("last generation %d, progress in %d of 100 runs", lastGen, progressed)
	// The next open removes a temp file a kill left behind.
	m, _ := openTestFile(t, path)
	m.Close()
	if _, err := os.Stat(path + tmpSuffix); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("temp file survives open: %v", err)
	}
}

// waitForGeneration waits until the map file holds a generation after
// last.
func waitForGeneration(t *testing.T, path string, last int) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for time.Now().Before(deadline) {
		if got, err := ReadFile(path); err == nil && len(got) > 0 && int(got[0].Value.Identity-0x01000000) > last {
			return
		}
		time.Sleep(time.Millisecond)
	}
	t.Fatalf("the writer did not get past generation %d within a minute", last)
}

func FuzzDecodeFile(f *testing.F) {
	raw := map[rawKey]rawValue{}
	for _, e := range testEntries(3) {
		var k rawKey
		var v rawValue
		e.Key.put(&k)
		e.Value.put(&v)
		raw[k] = v
	}
	f.Add(encodeFile(nil, raw))
	f.Add(encodeFile(nil, nil))
	f.Add([]byte("idipcmap"))
	f.Fuzz(func(t *testing.T, data []byte) {
		got, err := decodeFile(data)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("error does not wrap ErrCorrupt: %v", err)
			}
			return
		}
		again, err := decodeFile(encodeFile(nil, got))
		if err != nil || len(again) != len(got) {
			t.Fatalf("re-encoded file does not decode alike: %v", err)
		}
		for k, v := range got {
			if again[k] != v {
				t.Fatalf("record %x changed", k)
			}
		}
	})
}
