package ipcache_test

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/identityd/identityd/cells/checkpoint"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/internal/ipcachemap"
)

// BenchmarkUpsertDurable measures what the durability point costs: one
// upsert of new /32s (new local identities; one per call, or a batch of
// 100) per operation, returning before the map is written (nowait) or
// after WaitDurable (wait), from one caller or from 8 concurrent callers. The checkpoint is in the hive with
// an interval of an hour, so WaitDurable's checkpoint writes are the only
// ones. Set IPCACHE_BENCH_BACKEND=bpf (as root) for the bpf map.
func BenchmarkUpsertDurable(b *testing.B) {
	for _, wait := range []bool{false, true} {
		for _, c := range []struct{ callers, batch int }{{1, 1}, {8, 1}, {1, 100}} {
			name := fmt.Sprintf("wait=%v/callers=%d/batch=%d", wait, c.callers, c.batch)
			b.Run(name, func(b *testing.B) { benchUpsertDurable(b, wait, c.callers, c.batch) })
		}
	}
}

func benchUpsertDurable(b *testing.B, wait bool, callers, batch int) {
	cfg := func(c *ipcache.Config) { c.IPCacheMapMaxEntries = 1 << 24 }
	if backend := benchBackend(); backend == ipcachemap.KindBPF {
		pin := bpfPinPath(b)
		cfg = func(c *ipcache.Config) {
			c.IPCacheMap, c.IPCacheMapPinPath, c.IPCacheMapMaxEntries = string(ipcachemap.KindBPF), pin, 1<<24
		}
	}
	n := newNode(b, cfg, checkpoint.Cell)
	hiveOverrideCheckpointInterval(n, time.Hour)
	n.start(b)
	ctx := context.Background()
	var next atomic.Uint32
	op := func() error {
		updates := make([]ipcache.Update, batch)
		ps := make([]netip.Prefix, batch)
		for j := range updates {
			i := next.Add(1)
			ps[j] = netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}), 32)
			updates[j].Prefix = ps[j]
		}
		if err := n.ipc.UpsertBatch(ctx, "bench", updates); err != nil {
			return err
		}
		if wait {
			return n.ipc.WaitDurable(ctx, ps...)
		}
		return nil
	}
	start := time.Now()
	if callers == 1 {
		for b.Loop() {
			if err := op(); err != nil {
				b.Fatal(err)
			}
		}
	} else {
		// b.N split between the callers, each as fast as it is answered.
		var (
			wg   sync.WaitGroup
			left atomic.Int64
		)
		left.Store(int64(b.N))
		b.ResetTimer()
		start = time.Now()
		for range callers {
			wg.Go(func() {
				for left.Add(-1) >= 0 {
					if err := op(); err != nil {
						b.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
	}
	elapsed := time.Since(start)
	b.ReportMetric(float64(b.N*batch)/elapsed.Seconds(), "prefixes/s")
	b.ReportMetric(float64(elapsed.Microseconds())/float64(b.N)*float64(callers), "µs/call")
}

func benchBackend() ipcachemap.Kind {
	if k := ipcachemap.Kind(os.Getenv("IPCACHE_BENCH_BACKEND")); k != "" {
		return k
	}
	return ipcachemap.KindFile
}

// BenchmarkUpsertDurableSize measures one caller's waited upsert of a new
// /32 (a new local identity) with the file backend and 1k, 10k and 100k
// prefixes already in the ipcache, at the default checkpoint interval:
// "new" upserts a new prefix per operation, "again" one the owner already
// upserted (no write). p50-µs and p99-µs are single operations; a waited
// upsert includes the reconciler's next round (up to 20ms).
func BenchmarkUpsertDurableSize(b *testing.B) {
	for _, n := range []int{1_000, 10_000, 100_000} {
		for _, again := range []bool{false, true} {
			name := fmt.Sprintf("existing=%d/new", n)
			if again {
				name = fmt.Sprintf("existing=%d/again", n)
			}
			b.Run(name, func(b *testing.B) { benchUpsertDurableSize(b, n, again) })
		}
	}
}

func benchUpsertDurableSize(b *testing.B, n int, again bool) {
	node := newNode(b, func(c *ipcache.Config) { c.IPCacheMapMaxEntries = 1 << 24 }, checkpoint.Cell)
	node.start(b)
	ctx := context.Background()
	prefix := func(i int) netip.Prefix {
		return netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}), 32)
	}
	for lo := 0; lo < n; lo += 10_000 {
		var updates []ipcache.Update
		var ps []netip.Prefix
		for i := lo; i < min(n, lo+10_000); i++ {
			updates = append(updates, ipcache.Update{Prefix: prefix(i)})
			ps = append(ps, prefix(i))
		}
		if err := node.ipc.UpsertBatch(ctx, "bench", updates); err != nil {
			b.Fatal(err)
		}
		if err := node.ipc.WaitDurable(ctx, ps...); err != nil {
			b.Fatal(err)
		}
	}
	lat := make([]time.Duration, 0, 1024)
	i := n
	for b.Loop() {
		p := prefix(i)
		if again {
			p = prefix(i % n)
		}
		i++
		t0 := time.Now()
		if err := node.ipc.Upsert(ctx, "bench", p, ipcache.Info{}); err != nil {
			b.Fatal(err)
		}
		if err := node.ipc.WaitDurable(ctx, p); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(t0))
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds())/1e3, "p50-µs")
	b.ReportMetric(float64(lat[min(len(lat)-1, len(lat)*99/100)].Nanoseconds())/1e3, "p99-µs")
}
