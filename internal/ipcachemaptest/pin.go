// Package ipcachemaptest helps tests that run the ipcache on a real pinned
// BPF map.
package ipcachemaptest

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/identityd/identityd/internal/ipcachemap"
)

// PinPath returns a fresh pin path under the bpffs root, removed when the
// test ends, or skips the test saying why the bpf backend cannot run here.
// name tells the tests' directories apart on a shared host.
func PinPath(tb testing.TB, name string) string {
	tb.Helper()
	if os.Geteuid() != 0 {
		tb.Skip("the bpf ipcache map needs root (CAP_BPF, and CAP_SYS_ADMIN to mount bpffs): run the test as root")
	}
	dir := filepath.Join(ipcachemap.DefaultBPFFSRoot, fmt.Sprintf("identityd-%s-%d-%d", name, os.Getpid(), time.Now().UnixNano()))
	pin := filepath.Join(dir, "ipcache")
	tb.Cleanup(func() { os.RemoveAll(dir) })
	m, _, err := ipcachemap.Open(ipcachemap.Config{Kind: ipcachemap.KindBPF, PinPath: pin, MaxEntries: 16})
	if err != nil {
		tb.Skipf("the kernel refuses a pinned BPF LPM trie here: %v", err)
	}
	m.Close()
	os.Remove(pin)
	return pin
}
