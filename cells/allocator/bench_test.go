package allocator

import (
	"context"
	"log/slog"
	"net/netip"
	"runtime"
	"testing"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// cidrSets returns n distinct CIDR label sets (/32 host prefixes).
func cidrSets(n int) []labels.Labels {
	out := make([]labels.Labels, n)
	for i := range out {
		a := [4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}
		out[i] = labels.FromPrefix(netip.PrefixFrom(netip.AddrFrom4(a), 32), false)
	}
	return out
}

const benchSets = 1 << 20

// benchAllocator is an allocator as the cell builds it: with the
// identities table and the allocation-latency histogram.
func benchAllocator(b *testing.B) *identityAllocator {
	a, _, _ := testAllocator(b, identity.MaxLocalIdentity)
	a.metrics = newAllocationMetrics().Metrics
	return a
}

func reportRate(b *testing.B, what string) {
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), what+"/s")
}

// BenchmarkLocalNew measures allocating new node-local identities.
func BenchmarkLocalNew(b *testing.B) {
	sets := cidrSets(benchSets)
	a := benchAllocator(b)
	ctx := context.Background()
	i := 0
	for b.Loop() {
		if i == len(sets) {
			b.StopTimer()
			a.Stop(ctx)
			a = benchAllocator(b)
			i = 0
			b.StartTimer()
		}
		if _, allocated, err := a.Allocate(ctx, sets[i]); err != nil || !allocated {
			b.Fatal(err)
		}
		i++
	}
	reportRate(b, "identities")
}

// BenchmarkLocalNewParallel is BenchmarkLocalNew from GOMAXPROCS goroutines.
func BenchmarkLocalNewParallel(b *testing.B) {
	procs := runtime.GOMAXPROCS(0)
	sets := cidrSets(benchSets)
	if b.N > len(sets) {
		// Past the prepared sets the benchmark measures hits instead.
		sets = cidrSets(b.N + procs)
	}
	a := benchAllocator(b)
	ctx := context.Background()
	var next atomicCounter
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			i := next.add()
			if _, _, err := a.Allocate(ctx, sets[i]); err != nil {
				b.Error(err)
				return
			}
		}
	})
	reportRate(b, "identities")
}

// BenchmarkLocalHit measures taking another reference on a held identity.
func BenchmarkLocalHit(b *testing.B) {
	sets := cidrSets(1024)
	a := benchAllocator(b)
	ctx := context.Background()
	for _, s := range sets {
		a.Allocate(ctx, s)
	}
	i := 0
	for b.Loop() {
		if _, allocated, err := a.Allocate(ctx, sets[i&1023]); err != nil || allocated {
			b.Fatal(err)
		}
		i++
	}
	reportRate(b, "hits")
}

// BenchmarkLocalHitParallel is BenchmarkLocalHit from GOMAXPROCS goroutines.
func BenchmarkLocalHitParallel(b *testing.B) {
	sets := cidrSets(1024)
	a := benchAllocator(b)
	ctx := context.Background()
	for _, s := range sets {
		a.Allocate(ctx, s)
	}
	var seed atomicCounter
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		i := seed.add() * 512
		for pb.Next() {
			if _, _, err := a.Allocate(ctx, sets[i&1023]); err != nil {
				b.Error(err)
				return
			}
			i++
		}
	})
	reportRate(b, "hits")
}

// BenchmarkLocalRelease measures releasing the last reference.
func BenchmarkLocalRelease(b *testing.B) {
	sets := cidrSets(benchSets)
	ctx := context.Background()
	fill := func() (*identityAllocator, []*identity.Identity) {
		a := benchAllocator(b)
		ids := make([]*identity.Identity, len(sets))
		for i, s := range sets {
			ids[i], _, _ = a.Allocate(ctx, s)
		}
		return a, ids
	}
	a, ids := fill()
	i := 0
	for b.Loop() {
		if i == len(ids) {
			b.StopTimer()
			a.Stop(ctx)
			a, ids = fill()
			i = 0
			b.StartTimer()
		}
		if released, err := a.Release(ctx, ids[i]); err != nil || !released {
			b.Fatal(err)
		}
		i++
	}
	reportRate(b, "releases")
}

// BenchmarkLocalReleaseParallel is BenchmarkLocalRelease from GOMAXPROCS
// goroutines.
func BenchmarkLocalReleaseParallel(b *testing.B) {
	ctx := context.Background()
	n := max(b.N, 1)
	sets := cidrSets(n)
	a := benchAllocator(b)
	ids := make([]*identity.Identity, n)
	for i, s := range sets {
		ids[i], _, _ = a.Allocate(ctx, s)
	}
	var next atomicCounter
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := a.Release(ctx, ids[next.add()]); err != nil {
				b.Error(err)
				return
			}
		}
	})
	reportRate(b, "releases")
}

// BenchmarkLocalMemory measures the heap the allocator keeps per local
// identity (the label sets are the caller's and built beforehand).
func BenchmarkLocalMemory(b *testing.B) {
	const n = 200_000
	sets := cidrSets(n)
	ctx := context.Background()
	measure := func(withTable bool) float64 {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		var a *identityAllocator
		if withTable {
			a = benchAllocator(b)
		} else {
			a = newIdentityAllocator(DefaultConfig, slog.New(slog.DiscardHandler), nil, nil, nil, nil, identity.MaxLocalIdentity)
			a.Start(ctx)
		}
		for _, s := range sets {
			a.Allocate(ctx, s)
		}
		// Let the dispatcher and the table writer catch up, so that
		// what they keep is counted too.
		for a.disp.drain() > 0 {
		}
		a.table.flush()
		runtime.GC()
		runtime.ReadMemStats(&after)
		runtime.KeepAlive(a)
		a.Stop(ctx)
		return float64(after.HeapAlloc-before.HeapAlloc) / n
	}
	var core, total float64
	for b.Loop() {
		core = measure(false)
		total = measure(true)
	}
	b.ReportMetric(core, "B/identity")
	b.ReportMetric(total, "B/identity+table")
}
