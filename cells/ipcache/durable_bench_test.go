package ipcache_test

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/identityd/identityd/cells/checkpoint"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/internal/ipcachemap"
)

// BenchmarkUpsertDurable measures what the durability point costs: one
// upsert of a new /32 (a new local identity) per operation, returning
// before the map is written (nowait) or after WaitDurable (wait), from one
// caller or from 8 concurrent callers. The checkpoint is in the hive with
// an interval of an hour, so WaitDurable's checkpoint writes are the only
// ones. Set IPCACHE_BENCH_BACKEND=bpf (as root) for the bpf map.
func BenchmarkUpsertDurable(b *testing.B) {
	for _, wait := range []bool{false, true} {
		for _, callers := range []int{1, 8} {
			name := fmt.Sprintf("wait=%v/callers=%d", wait, callers)
			b.Run(name, func(b *testing.B) { benchUpsertDurable(b, wait, callers) })
		}
	}
}

func benchUpsertDurable(b *testing.B, wait bool, callers int) {
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
		i := next.Add(1)
		p := netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}), 32)
		if err := n.ipc.Upsert(ctx, "bench", p, ipcache.Info{}); err != nil {
			return err
		}
		if wait {
			return n.ipc.WaitDurable(ctx, p)
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
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "upserts/s")
	b.ReportMetric(float64(elapsed.Microseconds())/float64(b.N)*float64(callers), "µs/caller-op")
}

func benchBackend() ipcachemap.Kind {
	if k := ipcachemap.Kind(os.Getenv("IPCACHE_BENCH_BACKEND")); k != "" {
		return k
	}
	return ipcachemap.KindFile
}
