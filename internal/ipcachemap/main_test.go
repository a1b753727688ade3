package ipcachemap

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"

	"go.uber.org/goleak"
)

// childEnv selects a helper mode when the test binary re-executes itself as
// a child process (a new process is the only honest way to test pins and
// crash safety).
const (
	childEnv     = "IPCACHEMAP_TEST_CHILD"
	childPathEnv = "IPCACHEMAP_TEST_PATH"
)

func TestMain(m *testing.M) {
	switch mode := os.Getenv(childEnv); mode {
	case "":
	case "bpf-dump":
		os.Exit(childBPFDump(os.Getenv(childPathEnv)))
	case "file-writer":
		os.Exit(childFileWriter(os.Getenv(childPathEnv)))
	case "bpf-open", "file-open":
		os.Exit(childOpen(mode, os.Getenv(childPathEnv)))
	default:
		fmt.Fprintf(os.Stderr, "unknown child mode %q\n", mode)
		os.Exit(2)
	}
	goleak.VerifyTestMain(m)
}

// runChild starts this test binary in the given helper mode.
func childCommand(t testing.TB, mode, path string) *exec.Cmd {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+mode, childPathEnv+"="+path)
	return cmd
}

func randomSuffix() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// testEntries returns n distinct entries mixing families, prefix lengths,
// cluster IDs and value fields.
func testEntries(n int) []Entry {
	out := make([]Entry, 0, n)
	for i := range n {
		var k Key
		switch i % 4 {
		case 0, 1:
			k.Prefix = netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}), 32)
		case 2:
			k.Prefix = netip.PrefixFrom(netip.AddrFrom4([4]byte{172, byte(i >> 16), byte(i >> 8), byte(i)}), 32)
			k.ClusterID = uint16(1 + i%300)
		case 3:
			a := [16]byte{0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, byte(i >> 24), byte(i >> 16), byte(i >> 8), byte(i), 0}
			k.Prefix = netip.PrefixFrom(netip.AddrFrom16(a), 120)
		}
		v := Value{Identity: 0x01000000 + identityOf(i)}
		if i%5 == 0 {
			v.TunnelEndpoint = netip.AddrFrom4([4]byte{192, 168, byte(i >> 8), byte(i) | 1})
			v.EncryptKey = uint8(i % 16)
			v.Flags = uint8(i % 2)
		}
		out = append(out, Entry{Key: k, Value: v})
	}
	return out
}

func identityOf(i int) identityNum { return identityNum(i%0xFFFFFF + 1) }

func sortEntries(es []Entry) []Entry {
	slices.SortFunc(es, func(a, b Entry) int {
		ka, _ := a.Key.MarshalBinary()
		kb, _ := b.Key.MarshalBinary()
		return slices.Compare(ka, kb)
	})
	return es
}

func equalEntries(t testing.TB, got, want []Entry) {
	t.Helper()
	got = sortEntries(slices.Clone(got))
	want = sortEntries(slices.Clone(want))
	if len(got) != len(want) {
		t.Fatalf("got %d entries, want %d", len(got), len(want))
	}
	for i := range got {
		if got[i] != want[i] {
			t.Fatalf("entry %d: got %v=%+v, want %v=%+v", i, got[i].Key, got[i].Value, want[i].Key, want[i].Value)
		}
	}
}

func tempFilePath(t testing.TB) string {
	return filepath.Join(t.TempDir(), FileName)
}
