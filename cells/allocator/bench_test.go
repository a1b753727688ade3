package allocator

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive/script"
	"github.com/cilium/statedb"

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
			a.stopStandalone(ctx)
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
			a.stopStandalone(ctx)
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
			a.startStandalone(ctx)
		}
		for _, s := range sets {
			a.Allocate(ctx, s)
		}
		// Let the dispatcher and the table writer catch up, so that
		// what they keep is counted too.
		for a.disp.drain() > 0 {
		}
		a.table.Flush()
		runtime.GC()
		runtime.ReadMemStats(&after)
		runtime.KeepAlive(a)
		a.stopStandalone(ctx)
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

// churnCycles is, by default, a full wrap of a local scope's counter:
// every ID not held is handed out and released once, and the counter is
// back where it began.
var churnCycles = flag.Int("churn-cycles", 1<<24, "allocate/release cycles of BenchmarkAfterChurn")

// churnLiveSets is how many identities stay held through the churn.
const churnLiveSets = 1024

// churnAgent returns an allocator as the cell builds it, holding the live
// set, after cycles allocate/release cycles of other label sets.
func churnAgent(tb testing.TB, cycles int) *identityAllocator {
	db := statedb.New()
	table, err := NewTable(db)
	if err != nil {
		tb.Fatal(err)
	}
	a := newIdentityAllocator(DefaultConfig, slog.New(slog.DiscardHandler), db, table, nil, nil, identity.MaxLocalIdentity)
	a.metrics = newAllocationMetrics().Metrics
	if err := a.startStandalone(context.Background()); err != nil {
		tb.Fatal(err)
	}
	for _, s := range cidrSets(churnLiveSets) {
		mustAlloc(tb, a, s)
	}
	sets := churnSets(1 << 16)
	churnLocal(tb, a, sets, cycles)
	settle(a)
	// After a burst a node goes on with a trickle of changes, with which
	// the scratch lists shrink to the work of the moment.
	for range 2 {
		churnLocal(tb, a, sets, 1)
		settle(a)
	}
	return a
}

// BenchmarkAfterChurn measures an allocator after a full wrap of the
// local counter (-churn-cycles allocate/release cycles while churnLiveSets
// identities stay held) against a fresh one holding the same identities:
// new identities, lookups by labels and by ID, identity/allocate of a held
// set through the shell command, and, in child processes, the resident
// memory of each. Both allocators are measured in alternating
// rounds of the same process. -short leaves out the child processes.
func BenchmarkAfterChurn(b *testing.B) {
	ctx := context.Background()
	start := time.Now()
	churned := churnAgent(b, *churnCycles)
	churnTime := time.Since(start)
	defer churned.stopStandalone(ctx)
	fresh := churnAgent(b, 0)
	defer fresh.stopStandalone(ctx)

	var rssFresh, rssChurned float64
	if !testing.Short() {
		rssFresh, rssChurned = churnRSS(b, 0), churnRSS(b, *churnCycles)
	}

	held := cidrSets(churnLiveSets)
	heldIDs := make([]identity.NumericIdentity, len(held))
	for i, s := range held {
		heldIDs[i] = fresh.LookupByLabels(s).ID
	}
	const lookupPasses = 64
	newSets := cidrSets(16 * churnLiveSets)[churnLiveSets:]
	ids := make([]*identity.Identity, len(newSets))
	// The shell command of the issue: identity/allocate of a held set.
	const commandRuns = 16
	command := "identity/allocate -o json " + strings.Join(held[0].Strings(), " ")
	engine := func(a *identityAllocator) (*script.Engine, *script.State) {
		e := &script.Engine{Cmds: map[string]script.Cmd{}}
		for _, c := range newCommands(a).ScriptCmds {
			e.Cmds[c.Name] = c.Cmd
		}
		s, err := script.NewState(ctx, b.TempDir(), nil)
		if err != nil {
			b.Fatal(err)
		}
		return e, s
	}
	type shell struct {
		e *script.Engine
		s *script.State
	}
	shells := map[*identityAllocator]shell{}
	for _, a := range []*identityAllocator{fresh, churned} {
		e, s := engine(a)
		shells[a] = shell{e, s}
	}
	// cost is one round's time per operation, in ns.
	type cost struct{ alloc, byLabels, byID, command float64 }
	round := func(a *identityAllocator) cost {
		t0 := time.Now()
		for i, s := range newSets {
			id, allocated, err := a.Allocate(ctx, s)
			if err != nil || !allocated {
				b.Fatal(allocated, err)
			}
			ids[i] = id
		}
		t1 := time.Now()
		for range lookupPasses {
			for _, s := range held {
				if a.LookupByLabels(s) == nil {
					b.Fatal("held identity not found")
				}
			}
		}
		t2 := time.Now()
		for range lookupPasses {
			for _, id := range heldIDs {
				if a.LookupByID(id) == nil {
					b.Fatal("held identity not found")
				}
			}
		}
		t3 := time.Now()
		sh := shells[a]
		for range commandRuns {
			if err := sh.e.ExecuteLine(sh.s, command, io.Discard); err != nil {
				b.Fatal(err)
			}
		}
		t4 := time.Now()
		for range commandRuns {
			if _, err := a.Release(ctx, &identity.Identity{ID: heldIDs[0]}); err != nil {
				b.Fatal(err)
			}
		}
		for _, id := range ids {
			if _, err := a.Release(ctx, id); err != nil {
				b.Fatal(err)
			}
		}
		settle(a)
		lookups := float64(lookupPasses * len(held))
		return cost{
			alloc:    float64(t1.Sub(t0).Nanoseconds()) / float64(len(newSets)),
			byLabels: float64(t2.Sub(t1).Nanoseconds()) / lookups,
			byID:     float64(t3.Sub(t2).Nanoseconds()) / lookups,
			command:  float64(t4.Sub(t3).Nanoseconds()) / commandRuns,
		}
	}
	// Each round measures both, in alternating order; the figures are
	// medians over rounds, which a busy machine moves less than means.
	var freshCosts, churnedCosts []cost
	for b.Loop() {
		if len(freshCosts)%2 == 0 {
			freshCosts = append(freshCosts, round(fresh))
			churnedCosts = append(churnedCosts, round(churned))
		} else {
			churnedCosts = append(churnedCosts, round(churned))
			freshCosts = append(freshCosts, round(fresh))
		}
	}
	median := func(cs []cost, field func(cost) float64) float64 {
		v := make([]float64, len(cs))
		for i, c := range cs {
			v[i] = field(c)
		}
		slices.Sort(v)
		return v[len(v)/2]
	}
	b.ReportMetric(float64(*churnCycles)/churnTime.Seconds(), "churn-cycles/s")
	for _, m := range []struct {
		name  string
		field func(cost) float64
	}{
		{"new", func(c cost) float64 { return c.alloc }},
		{"lookup", func(c cost) float64 { return c.byLabels }},
		{"byid", func(c cost) float64 { return c.byID }},
		{"command", func(c cost) float64 { return c.command }},
	} {
		f, c := median(freshCosts, m.field), median(churnedCosts, m.field)
		b.ReportMetric(f, "fresh-"+m.name+"-ns")
		b.ReportMetric(c, "churned-"+m.name+"-ns")
		b.ReportMetric(c/f, m.name+"-ratio")
	}
	if rssFresh > 0 {
		b.ReportMetric(rssFresh/(1<<20), "fresh-rss-MiB")
		b.ReportMetric(rssChurned/(1<<20), "churned-rss-MiB")
		b.ReportMetric(rssChurned/rssFresh, "rss-ratio")
	}
}

// churnRSSEnv makes the test binary a child of churnRSS.
const churnRSSEnv = "IDENTITYD_CHURN_RSS_CYCLES"

// churnRSS runs churnAgent in a child process of this test binary and
// returns the child's resident memory afterwards: in this process the
// other allocators and label sets would count too.
func churnRSS(b *testing.B, cycles int) float64 {
	cmd := exec.CommandContext(b.Context(), os.Args[0], "-test.run=^TestChurnRSSChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%d", churnRSSEnv, cycles))
	out, err := cmd.CombinedOutput()
	if err != nil {
		b.Fatalf("child process: %v\n%s", err, out)
	}
	for line := range strings.Lines(string(out)) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "rss-bytes "); ok {
			n, err := strconv.ParseFloat(v, 64)
			if err != nil {
				b.Fatal(err)
			}
			return n
		}
	}
	b.Fatalf("child process printed no rss-bytes line:\n%s", out)
	return 0
}

// TestChurnRSSChild is BenchmarkAfterChurn's child process: it builds
// an agent's allocator after the cycles named in its environment and
// prints its resident memory. Run on its own, it is skipped.
func TestChurnRSSChild(t *testing.T) {
	v := os.Getenv(churnRSSEnv)
	if v == "" {
		t.Skip("the child process of BenchmarkAfterChurn")
	}
	cycles, err := strconv.Atoi(v)
	if err != nil {
		t.Fatal(err)
	}
	a := churnAgent(t, cycles)
	defer a.stopStandalone(context.Background())
	runtime.GC()
	debug.FreeOSMemory()
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Skipf("no resident memory figure: %v", err)
	}
	for line := range strings.Lines(string(status)) {
		if kb, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			n, err := strconv.Atoi(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(kb), "kB")))
			if err != nil {
				t.Fatal(err)
			}
			fmt.Printf("rss-bytes %d\n", n<<10)
			runtime.KeepAlive(a)
			return
		}
	}
	t.Fatal("no VmRSS in /proc/self/status")
}
