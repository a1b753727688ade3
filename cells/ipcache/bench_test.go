package ipcache_test

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"net/netip"
	"runtime"
	"testing"
	"time"

	"github.com/cilium/hive/hivetest"

	"github.com/identityd/identityd/cells/ipcache"
)

// prefixes returns n distinct /32 IPv4 prefixes.
func prefixes(n int) []ipcache.Update {
	out := make([]ipcache.Update, n)
	for i := range out {
		a := netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})
		out[i] = ipcache.Update{Prefix: netip.PrefixFrom(a, 32)}
	}
	return out
}

// upsertAll upserts updates in batches and waits until the map has them.
func upsertAll(b *testing.B, c *ipcache.IPCache, updates []ipcache.Update, batch int) {
	ctx := context.Background()
	for i := 0; i < len(updates); i += batch {
		if err := c.UpsertBatch(ctx, "bench", updates[i:min(i+batch, len(updates))]); err != nil {
			b.Fatal(err)
		}
	}
	wctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	if err := c.WaitForMap(wctx); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkUpsert100k measures 100,000 CIDR prefixes end to end: labels,
// identity allocation, table, and the reconciler's write into the map.
func BenchmarkUpsert100k(b *testing.B) {
	const n, batch = 100_000, 10_000
	updates := prefixes(n)
	node := newNode(b, nil)
	node.start(b)
	var elapsed time.Duration
	for b.Loop() {
		start := time.Now()
		upsertAll(b, node.ipc, updates, batch)
		elapsed += time.Since(start)

		b.StopTimer()
		if _, err := node.ipc.RemoveOwner(context.Background(), "bench"); err != nil {
			b.Fatal(err)
		}
		if err := node.ipc.WaitForMap(context.Background()); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	b.ReportMetric(float64(n*b.N)/elapsed.Seconds(), "prefixes/s")
}

// BenchmarkLookup measures a longest-prefix lookup in a table of 100,000
// /32 prefixes under 256 /16s and a default route.
func BenchmarkLookup(b *testing.B) {
	updates := prefixes(100_000)
	for i := range 256 {
		updates = append(updates, ipcache.Update{Prefix: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i), 0, 0}), 16)})
	}
	updates = append(updates, ipcache.Update{Prefix: netip.MustParsePrefix("0.0.0.0/0")})
	node := newNode(b, nil)
	node.start(b)
	upsertAll(b, node.ipc, updates, 10_000)
	addrs := make([]netip.Addr, 1024)
	r := rand.New(rand.NewPCG(1, 2))
	for i := range addrs {
		addrs[i] = netip.AddrFrom4([4]byte{10, byte(r.IntN(3)), byte(r.IntN(256)), byte(r.IntN(256))})
	}
	i := 0
	for b.Loop() {
		if _, ok := node.ipc.Lookup(addrs[i%len(addrs)]); !ok {
			b.Fatal("lookup missed")
		}
		i++
	}
}

// BenchmarkMillionPrefixes fills the table and the map with 1,000,000
// prefixes and reports the heap they take, all included: rows and indexes,
// one local identity each in the allocator, and the file backend's copy.
func BenchmarkMillionPrefixes(b *testing.B) {
	const n = 1_000_000
	for b.Loop() {
		b.StopTimer()
		node := newNode(b, func(c *ipcache.Config) { c.IPCacheMapMaxEntries = n })
		node.start(b)
		updates := prefixes(n)
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		b.StartTimer()

		start := time.Now()
		upsertAll(b, node.ipc, updates, 10_000)
		elapsed := time.Since(start)

		b.StopTimer()
		runtime.GC()
		runtime.ReadMemStats(&after)
		if got := len(node.ipc.List()); got != n {
			b.Fatalf("table has %d rows", got)
		}
		b.ReportMetric(float64(n)/elapsed.Seconds(), "prefixes/s")
		b.ReportMetric(float64(int64(after.HeapAlloc)-int64(before.HeapAlloc))/n, "B/prefix")
		runtime.KeepAlive(updates)
		node.hive.Stop(hivetest.Logger(b, hivetest.LogLevel(slog.LevelWarn)), context.Background())
		b.StartTimer()
	}
}
