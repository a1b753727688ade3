package ciliumanchor

import (
	"context"
	"net/netip"
	"runtime"
	"testing"

	"github.com/cilium/cilium/pkg/identity"
	"github.com/cilium/cilium/pkg/identity/cache"
	"github.com/cilium/cilium/pkg/labels"
)

// cidrSets returns n distinct CIDR label sets (/32 host prefixes), as
// identityd's benchmarks do: GetCIDRLabels gives the prefix's label and
// reserved:world, the two labels of identityd's labels.FromPrefix.
func cidrSets(n int) []labels.Labels {
	out := make([]labels.Labels, n)
	for i := range out {
		a := [4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}
		out[i] = labels.GetCIDRLabels(netip.PrefixFrom(netip.AddrFrom4(a), 32))
	}
	return out
}

const benchSets = 1 << 20

// owner is the least a Cilium allocator needs from its agent.
type owner struct{}

func (owner) UpdateIdentities(added, deleted identity.IdentityMap) {}
func (owner) GetNodeSuffix() string                                { return "anchor" }

// newAllocator is Cilium's allocator as its agent builds it, without a
// kvstore: local identities need none. Allocations pass notifyOwner=false,
// as Cilium's ipcache does for CIDR identities, which also spares Cilium
// the event that identityd always publishes.
func newAllocator() *cache.CachingIdentityAllocator {
	return cache.NewCachingIdentityAllocator(owner{})
}

func reportRate(b *testing.B, what string) {
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), what+"/s")
}

// BenchmarkLocalNew measures allocating new node-local identities.
func BenchmarkLocalNew(b *testing.B) {
	sets := cidrSets(benchSets)
	m := newAllocator()
	ctx := context.Background()
	i := 0
	for b.Loop() {
		if i == len(sets) {
			b.StopTimer()
			m = newAllocator()
			i = 0
			b.StartTimer()
		}
		if _, allocated, err := m.AllocateIdentity(ctx, sets[i], false, 0); err != nil || !allocated {
			b.Fatal(err)
		}
		i++
	}
	reportRate(b, "identities")
}

// BenchmarkLocalHit measures taking another reference on a held identity.
func BenchmarkLocalHit(b *testing.B) {
	sets := cidrSets(1024)
	m := newAllocator()
	ctx := context.Background()
	for _, s := range sets {
		m.AllocateIdentity(ctx, s, false, 0)
	}
	i := 0
	for b.Loop() {
		if _, allocated, err := m.AllocateIdentity(ctx, sets[i&1023], false, 0); err != nil || allocated {
			b.Fatal(err)
		}
		i++
	}
	reportRate(b, "hits")
}

// BenchmarkLocalRelease measures releasing the last reference.
func BenchmarkLocalRelease(b *testing.B) {
	sets := cidrSets(benchSets)
	ctx := context.Background()
	fill := func() (*cache.CachingIdentityAllocator, []*identity.Identity) {
		m := newAllocator()
		ids := make([]*identity.Identity, len(sets))
		for i, s := range sets {
			ids[i], _, _ = m.AllocateIdentity(ctx, s, false, 0)
		}
		return m, ids
	}
	m, ids := fill()
	i := 0
	for b.Loop() {
		if i == len(ids) {
			b.StopTimer()
			m, ids = fill()
			i = 0
			b.StartTimer()
		}
		if released, err := m.Release(ctx, ids[i], false); err != nil || !released {
			b.Fatal(err)
		}
		i++
	}
	reportRate(b, "releases")
}

// BenchmarkLocalMemory measures the heap the allocator keeps per local
// identity (the label sets are the caller's and built beforehand).
func BenchmarkLocalMemory(b *testing.B) {
	const n = 200_000
	sets := cidrSets(n)
	ctx := context.Background()
	var perIdentity float64
	for b.Loop() {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		m := newAllocator()
		for _, s := range sets {
			m.AllocateIdentity(ctx, s, false, 0)
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		runtime.KeepAlive(m)
		perIdentity = float64(after.HeapAlloc-before.HeapAlloc) / n
	}
	b.ReportMetric(perIdentity, "B/identity")
}
