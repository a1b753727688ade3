package ipcache_test

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/hive/hivetest"

	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/internal/ipcachemap"
)

// bpfPinPath returns a fresh pin path under /sys/fs/bpf, or skips the test
// saying why the bpf backend cannot run here.
func bpfPinPath(t testing.TB) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("the bpf ipcache map needs root (CAP_BPF, and CAP_SYS_ADMIN to mount bpffs)")
	}
	dir := filepath.Join(ipcachemap.DefaultBPFFSRoot, fmt.Sprintf("identityd-ipcache-test-%d-%d", os.Getpid(), time.Now().UnixNano()))
	pin := filepath.Join(dir, "ipcache")
	t.Cleanup(func() { os.RemoveAll(dir) })
	m, _, err := ipcachemap.Open(ipcachemap.Config{Kind: ipcachemap.KindBPF, PinPath: pin, MaxEntries: 16})
	if err != nil {
		t.Skipf("the kernel refuses a pinned BPF LPM trie here: %v", err)
	}
	m.Close()
	os.Remove(pin)
	return pin
}

// TestBPFMap runs the ipcache on a real pinned BPF LPM trie: rows converge
// into the kernel map, the kernel answers longest-prefix lookups, and a
// restart finds the old entries in its snapshot.
func TestBPFMap(t *testing.T) {
	pin := bpfPinPath(t)
	cfg := func(c *ipcache.Config) {
		c.IPCacheMap = string(ipcachemap.KindBPF)
		c.IPCacheMapPinPath = pin
		c.IPCacheMapMaxEntries = 1_000_000
	}
	n := newNode(t, cfg)
	n.start(t)
	if n.ipc.MapKind() != ipcachemap.KindBPF {
		t.Fatalf("map kind %s", n.ipc.MapKind())
	}
	ctx := t.Context()
	for _, p := range []string{"10.0.0.0/8", "10.1.0.0/16", "2001:db8::/32"} {
		if err := n.ipc.Upsert(ctx, "k8s", pfx(p), ipcache.Info{}); err != nil {
			t.Fatal(err)
		}
	}
	waitMap(t, n.ipc)
	dump, err := n.ipc.MapDump()
	if err != nil {
		t.Fatal(err)
	}
	if len(dump) != 3 {
		t.Fatalf("bpf map holds %+v", dump)
	}
	// The kernel's own longest-prefix match agrees with the table.
	m, _, err := ipcachemap.Open(ipcachemap.Config{Kind: ipcachemap.KindBPF, PinPath: pin, MaxEntries: 1_000_000})
	if err != nil {
		t.Fatal(err)
	}
	v, ok, err := m.Lookup(ipcachemap.Key{Prefix: pfx("10.1.2.3/32")})
	m.Close()
	if err != nil || !ok || v.Identity != mustGet(t, n.ipc, "10.1.0.0/16").Identity {
		t.Fatalf("kernel lookup of 10.1.2.3: %+v %v %v", v, ok, err)
	}
	want := mustGet(t, n.ipc, "2001:db8::/32").Identity
	if err := n.hive.Stop(hivetest.Logger(t), context.Background()); err != nil {
		t.Fatal(err)
	}

	// The pinned map outlives the agent; the next run snapshots it.
	n2 := newNode(t, cfg)
	n2.start(t)
	snap := n2.ipc.TakeSnapshot()
	found := false
	for _, e := range snap {
		if e.Key.Prefix == netip.MustParsePrefix("2001:db8::/32") && e.Value.Identity == want {
			found = true
		}
	}
	if len(snap) != 3 || !found {
		t.Fatalf("snapshot after restart: %+v", snap)
	}
}

// TestAutoMap checks that auto picks bpf where a map can be pinned, and
// falls back to the file in the state directory where it cannot.
func TestAutoMap(t *testing.T) {
	t.Run("bpf", func(t *testing.T) {
		pin := bpfPinPath(t)
		n := newNode(t, func(c *ipcache.Config) {
			c.IPCacheMap = string(ipcachemap.KindAuto)
			c.IPCacheMapPinPath = pin
		})
		n.start(t)
		if n.ipc.MapKind() != ipcachemap.KindBPF {
			t.Fatalf("auto chose %s where bpf works", n.ipc.MapKind())
		}
	})
	t.Run("file", func(t *testing.T) {
		// A pin path outside any bpffs cannot hold a pinned map.
		n := newNode(t, func(c *ipcache.Config) {
			c.IPCacheMap = string(ipcachemap.KindAuto)
			c.IPCacheMapPinPath = filepath.Join(t.TempDir(), "not-bpffs", "ipcache")
		})
		n.start(t)
		if n.ipc.MapKind() != ipcachemap.KindFile {
			t.Fatalf("auto chose %s where bpf cannot pin", n.ipc.MapKind())
		}
		if err := n.ipc.Upsert(t.Context(), "k8s", pfx("10.0.0.0/8"), ipcache.Info{}); err != nil {
			t.Fatal(err)
		}
		waitMap(t, n.ipc)
		if err := n.hive.Stop(hivetest.Logger(t), context.Background()); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(filepath.Join(n.dir, ipcachemap.FileName)); err != nil {
			t.Fatalf("file backend did not write to the state directory: %v", err)
		}
	})
}
