package ipcache_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/hive/hivetest"

	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/internal/ipcachemap"
	"github.com/identityd/identityd/internal/ipcachemaptest"
)

// bpfPinPath returns a fresh pin path for the bpf backend, or skips the
// test saying why it cannot run here.
func bpfPinPath(t testing.TB) string { return ipcachemaptest.PinPath(t, "ipcache-test") }

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
	if n.ipc.MapKind() != ipcache.MapKindBPF {
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
	want := mustGet(t, n.ipc, "2001:db8::/32").Identity
	want16 := mustGet(t, n.ipc, "10.1.0.0/16").Identity
	if err := n.hive.Stop(hivetest.Logger(t), context.Background()); err != nil {
		t.Fatal(err)
	}

	// The kernel's own longest-prefix match agrees with the table (read
	// once the agent is gone: while it runs, it alone holds the map).
	m, _, err := ipcachemap.Open(ipcachemap.Config{Kind: ipcachemap.KindBPF, PinPath: pin, MaxEntries: 1_000_000})
	if err != nil {
		t.Fatal(err)
	}
	v, ok, err := m.Lookup(ipcachemap.Key{Prefix: pfx("10.1.2.3/32")})
	m.Close()
	if err != nil || !ok || v.Identity != want16 {
		t.Fatalf("kernel lookup of 10.1.2.3: %+v %v %v", v, ok, err)
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

// TestTwoAgentsOneMap starts two agents (two hives in one process) on one
// pin path: the second must be refused, naming the pin and the holder,
// before it can snapshot or prune anything, and the first's 100 entries
// must stay in the kernel map. With kind auto the second must not fall
// back to a file map either: it would run without a datapath.
func TestTwoAgentsOneMap(t *testing.T) {
	pin := bpfPinPath(t)
	for _, kind := range []ipcachemap.Kind{ipcachemap.KindBPF, ipcachemap.KindAuto} {
		t.Run(string(kind), func(t *testing.T) {
			cfg := func(c *ipcache.Config) {
				c.IPCacheMap = string(kind)
				c.IPCacheMapPinPath = pin
			}
			first := newNode(t, cfg)
			first.start(t)
			ctx := t.Context()
			var updates []ipcache.Update
			for i := range 100 {
				updates = append(updates, ipcache.Update{Prefix: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 7, byte(i), 0}), 24)})
			}
			if err := first.ipc.UpsertBatch(ctx, "k8s", updates); err != nil {
				t.Fatal(err)
			}
			waitMap(t, first.ipc)

			second := newNode(t, cfg)
			err := second.hive.Start(hivetest.Logger(t), context.Background())
			second.hive.Stop(hivetest.Logger(t), context.Background())
			if !errors.Is(err, ipcachemap.ErrInUse) {
				t.Fatalf("second agent on %s: %v, want ErrInUse", pin, err)
			}
			if !errors.Is(err, ipcache.ErrMapInUse) {
				t.Fatalf("second agent on %s: %v, want ipcache.ErrMapInUse", pin, err)
			}
			for _, want := range []string{pin, fmt.Sprintf("pid %d", os.Getpid())} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not name %q", err, want)
				}
			}
			// The first agent's table and map are untouched, also after
			// a pruning round would have run.
			dump, err := first.ipc.MapDump()
			if err != nil || len(dump) != 100 {
				t.Fatalf("first agent's map after the second was refused: %d entries, %v", len(dump), err)
			}
			if err := first.hive.Stop(hivetest.Logger(t), context.Background()); err != nil {
				t.Fatal(err)
			}
			// Once the first agent is gone the pin is free again.
			third := newNode(t, cfg)
			third.start(t)
			if n := len(third.ipc.TakeSnapshot()); n != 100 {
				t.Fatalf("next agent found %d entries, want 100", n)
			}
			if err := third.hive.Stop(hivetest.Logger(t), context.Background()); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestTwoAgentsOneMapFile is TestTwoAgentsOneMap for the file backend:
// two agents on one state directory, so on one map file.
func TestTwoAgentsOneMapFile(t *testing.T) {
	first := newNode(t, nil)
	first.start(t)
	if err := first.ipc.Upsert(t.Context(), "k8s", pfx("10.0.0.0/8"), ipcache.Info{}); err != nil {
		t.Fatal(err)
	}
	waitMap(t, first.ipc)
	second := newNode(t, nil)
	second.dir = first.dir // read when the hive populates its config
	err := second.hive.Start(hivetest.Logger(t), context.Background())
	second.hive.Stop(hivetest.Logger(t), context.Background())
	// The state directory's lock refuses it before the map's would.
	if !errors.Is(err, statedir.ErrLocked) || !strings.Contains(err.Error(), first.dir) {
		t.Fatalf("second agent on %s: %v, want ErrLocked naming the directory", first.dir, err)
	}
	if dump, err := first.ipc.MapDump(); err != nil || len(dump) != 1 {
		t.Fatalf("first agent's map: %+v, %v", dump, err)
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
		if n.ipc.MapKind() != ipcache.MapKindBPF {
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
		if n.ipc.MapKind() != ipcache.MapKindFile {
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
