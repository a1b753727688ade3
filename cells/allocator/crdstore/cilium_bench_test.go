package crdstore

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/flowcontrol"

	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// raceResult sums the rounds of one side of BenchmarkCiliumThreeNodes.
type raceResult struct {
	sets       int
	elapsed    time.Duration
	objects    int // CiliumIdentity objects created for the sets
	mismatches int // sets the three nodes answered with different IDs
}

func (r *raceResult) add(o raceResult) {
	r.sets += o.sets
	r.elapsed += o.elapsed
	r.objects += o.objects
	r.mismatches += o.mismatches
}

func (r raceResult) rate() float64 { return float64(r.sets) / r.elapsed.Seconds() }

// raceNodes is how many nodes race, and raceGoroutines how many label sets
// each allocates at a time.
const (
	raceNodes      = 3
	raceGoroutines = 8
)

// BenchmarkCiliumThreeNodes is BenchmarkThreeNodes beside Cilium in the same
// run: three Cilium v1.16.2 agents (crdnode, CRD mode, 8 label sets at a
// time each, a client rate limit too high to throttle, as identityd's has
// none by default) race on 2,000 new label sets, then three identityd nodes (8
// goroutines each) on 2,000 other new sets, each side on a fresh API server
// of its own, the order of the sides alternating per round. It reports the
// distinct identities per second of each side, their ratio, the objects
// created per label set and the sets the nodes disagree on; and, as the
// physical limit, bare creates of as many objects on a fresh server that
// three identityd nodes watch: by 3 × 8 goroutines (bare-creates/s), and by
// 8 (bare8-creates/s), the most distinct creates the race has in flight,
// since the three nodes take the same sets in the same order. It builds
// Cilium, like TestCiliumInterop, so it runs only with
// IDENTITYD_CILIUM_INTEROP=1 (make bench-cilium).
func BenchmarkCiliumThreeNodes(b *testing.B) {
	if os.Getenv(ciliumInteropEnv) == "" {
		b.Skipf("set %s=1 to build Cilium v1.16.2's CRD allocator and race it (make bench-cilium)", ciliumInteropEnv)
	}
	bin := ciliumBinary(b)
	const sets = 2000
	var cilium, ours, bare, bare8 raceResult
	round := 0
	for b.Loop() {
		sides := []func(){
			func() {
				r := raceCilium(b, bin, benchSets(sets))
				b.Logf("round %d: Cilium %.0f identities/s, %.3f objects/set, %d mismatches", round, r.rate(), float64(r.objects)/float64(r.sets), r.mismatches)
				cilium.add(r)
			},
			func() {
				r := raceIdentityd(b, benchSets(sets))
				b.Logf("round %d: identityd %.0f identities/s, %.3f objects/set, %d mismatches", round, r.rate(), float64(r.objects)/float64(r.sets), r.mismatches)
				ours.add(r)
			},
			func() {
				r := raceBare(b, benchSets(sets), raceNodes*raceGoroutines)
				b.Logf("round %d: bare creates by %d goroutines %.0f objects/s", round, raceNodes*raceGoroutines, r.rate())
				bare.add(r)
			},
			func() {
				r := raceBare(b, benchSets(sets), raceGoroutines)
				b.Logf("round %d: bare creates by %d goroutines %.0f objects/s", round, raceGoroutines, r.rate())
				bare8.add(r)
			},
		}
		if round%2 == 1 {
			slices.Reverse(sides)
		}
		for _, side := range sides {
			side()
		}
		round++
	}
	b.ReportMetric(cilium.rate(), "cilium-identities/s")
	b.ReportMetric(ours.rate(), "identityd-identities/s")
	b.ReportMetric(ours.rate()/cilium.rate(), "x-cilium")
	b.ReportMetric(bare.rate(), "bare-creates/s")
	b.ReportMetric(ours.rate()/bare.rate(), "identityd/bare")
	b.ReportMetric(bare8.rate(), "bare8-creates/s")
	b.ReportMetric(ours.rate()/bare8.rate(), "identityd/bare8")
	b.ReportMetric(float64(cilium.objects)/float64(cilium.sets), "cilium-objects/set")
	b.ReportMetric(float64(ours.objects)/float64(ours.sets), "identityd-objects/set")
	b.ReportMetric(float64(cilium.mismatches), "cilium-mismatches")
	b.ReportMetric(float64(ours.mismatches), "identityd-mismatches")
}

// warmSet is a label set of its own for node i of a round, allocated before
// the race so that the race starts on nodes that are listed and connected.
func warmSet(round int64, i int) labels.Labels {
	return labels.MustParse(fmt.Sprintf("k8s:app=warm-%d-%d", round, i), "k8s:io.kubernetes.pod.namespace=bench")
}

// raceCilium races three crdnode processes on sets.
func raceCilium(b *testing.B, bin string, sets []labels.Labels) raceResult {
	srv := startServer(b)
	defer srv.Stop(b)
	round := benchRun.Add(1)
	var agents []*ciliumAgent
	for i := range raceNodes {
		a := startCilium(b, bin, srv.Kubeconfig(), "-parallel", fmt.Sprint(raceGoroutines), "-timeout", "5m", "-qps", "100000", "-burst", "100000")
		if ans := a.ask(warmSet(round, i)); ans.err != "" || ans.id == 0 {
			b.Fatalf("crdnode %d: warm-up allocation: %+v", i, ans)
		}
		agents = append(agents, a)
	}
	answers := make([]map[string]identity.NumericIdentity, raceNodes)
	errs := make([]error, raceNodes)
	var wg sync.WaitGroup
	start := time.Now()
	for i, a := range agents {
		wg.Go(func() { answers[i], errs[i] = a.allocateAll(sets) })
	}
	wg.Wait()
	elapsed := time.Since(start)
	for _, a := range agents {
		a.close()
	}
	for i, err := range errs {
		if err != nil {
			b.Fatalf("crdnode %d: %v", i, err)
		}
	}
	r := raceResult{sets: len(sets), elapsed: elapsed, objects: len(newClient(b, srv.RESTConfig()).identities(b)) - raceNodes}
	for _, s := range sets {
		k := s.Canonical()
		if answers[0][k] != answers[1][k] || answers[0][k] != answers[2][k] {
			r.mismatches++
		}
	}
	return r
}

// allocateAll sends every set at once and reads an answer for each, in
// whatever order crdnode settles them, by the label set's key.
func (a *ciliumAgent) allocateAll(sets []labels.Labels) (map[string]identity.NumericIdentity, error) {
	go func() {
		for _, s := range sets {
			if _, err := io.WriteString(a.stdin, ciliumInput(s)+"\n"); err != nil {
				return
			}
		}
	}()
	out := make(map[string]identity.NumericIdentity, len(sets))
	timeout := time.After(10 * time.Minute)
	for range sets {
		select {
		case line, ok := <-a.lines:
			if !ok {
				return nil, fmt.Errorf("exited after %d answers", len(out))
			}
			ans := parseAnswer(a.t, line)
			if ans.err != "" {
				return nil, fmt.Errorf("%s: %s", ans.key, ans.err)
			}
			out[ans.key] = ans.id
		case <-timeout:
			return nil, fmt.Errorf("%d of %d answers within 10 minutes", len(out), len(sets))
		}
	}
	return out, nil
}

// raceIdentityd races three identityd nodes on sets.
func raceIdentityd(b *testing.B, sets []labels.Labels) raceResult {
	srv := startServer(b)
	defer srv.Stop(b)
	round := benchRun.Add(1)
	var nodes []*testNode
	for i := range raceNodes {
		n := startNode(b, srv.RESTConfig(), fmt.Sprintf("race-%d-%d", round, i))
		defer n.stop()
		n.allocate(b, warmSet(round, i))
		nodes = append(nodes, n)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	ids := make([][]identity.NumericIdentity, raceNodes)
	errs := make([]error, raceNodes)
	var wg sync.WaitGroup
	start := time.Now()
	for i, n := range nodes {
		wg.Go(func() { ids[i], errs[i] = allocateAll(ctx, n, sets, raceGoroutines) })
	}
	wg.Wait()
	elapsed := time.Since(start)
	for _, err := range errs {
		if err != nil {
			b.Fatal(err)
		}
	}
	r := raceResult{sets: len(sets), elapsed: elapsed, objects: len(newClient(b, srv.RESTConfig()).identities(b)) - raceNodes}
	for j := range sets {
		if ids[0][j] != ids[1][j] || ids[0][j] != ids[2][j] {
			r.mismatches++
		}
	}
	return r
}

// raceBare creates len(sets) CiliumIdentity objects of distinct label sets
// with the given number of goroutines and no store, on a fresh server whose
// objects three identityd nodes watch, as in raceIdentityd.
func raceBare(b *testing.B, sets []labels.Labels, goroutines int) raceResult {
	srv := startServer(b)
	defer srv.Stop(b)
	round := benchRun.Add(1)
	for i := range raceNodes {
		n := startNode(b, srv.RESTConfig(), fmt.Sprintf("bare-%d-%d", round, i))
		defer n.stop()
		n.allocate(b, warmSet(round, i))
	}
	cli := newClient(b, srv.RESTConfig())
	work := make(chan int, len(sets))
	for i := range sets {
		work <- i
	}
	close(work)
	var failed atomic.Value
	var wg sync.WaitGroup
	start := time.Now()
	for range goroutines {
		wg.Go(func() {
			for i := range work {
				// IDs from 10000 up: the warm-up sets are placed by
				// hash and may take one, which is then skipped.
				obj := newIdentityObject(identity.NumericIdentity(10000+i), sets[i])
				if err := cli.cilium.Post().Resource("ciliumidentities").Body(obj).Do(context.Background()).Error(); err != nil && !apierrors.IsAlreadyExists(err) {
					failed.Store(err)
				}
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	if err, _ := failed.Load().(error); err != nil {
		b.Fatal(err)
	}
	return raceResult{sets: len(sets), elapsed: elapsed, objects: len(sets)}
}

// Settings of the mixed race (BenchmarkCiliumMixed).
const (
	// mixedQPS is the identityd nodes' --k8s-client-qps (and burst).
	mixedQPS = 40
	// mixedDelay is what the proxy in front of one identityd node adds
	// to each direction of its connections.
	mixedDelay = 50 * time.Millisecond
	// mixedReady is how long after the race the identityd nodes have to
	// report every health scope OK.
	mixedReady = 30 * time.Second
)

// mixedResult sums the rounds of BenchmarkCiliumMixed.
type mixedResult struct {
	rounds, sets int
	// split: sets the two identityd nodes answered differently;
	// unready: identityd nodes not ready at the end of a round.
	split, unready int
	// ciliumDiffer: sets a Cilium agent answered differently from the
	// identityd nodes; objects: CiliumIdentity objects of the race's sets.
	ciliumDiffer, objects int
	race                  time.Duration
	// lateIdentityd, lateCilium: a node that starts after the race
	// allocating the race's sets; lateRequests: the API server's
	// requests for CiliumIdentity objects meanwhile.
	lateIdentityd, lateCilium time.Duration
	lateRequests              float64
}

func (r *mixedResult) add(o mixedResult) {
	r.rounds += o.rounds
	r.sets += o.sets
	r.split += o.split
	r.unready += o.unready
	r.ciliumDiffer += o.ciliumDiffer
	r.objects += o.objects
	r.race += o.race
	r.lateIdentityd += o.lateIdentityd
	r.lateCilium += o.lateCilium
	r.lateRequests += o.lateRequests
}

// BenchmarkCiliumMixed is the mixed race beside Cilium: two identityd nodes
// whose clients are limited to 40 requests/s (--k8s-client-qps=40), one of
// them behind a proxy that delays each direction of its connections by
// 50 ms, and two Cilium v1.16.2 agents (crdnode, CRD mode, 8 label sets at
// a time each, their clients limited alike) allocate the same 2,000 new label sets at once on one API
// server; then a third identityd node, and a third Cilium agent, started
// after the race, allocate the same sets, one after the other. Per round
// (a fresh server each) it logs, and in total it reports: the sets the two
// identityd nodes answered differently (split, want 0), the identityd
// nodes with a health scope not OK mixedReady after the race (unready,
// want 0), the sets a Cilium agent answered otherwise than identityd, the
// objects per set, and the late nodes' times and the late identityd node's
// requests per set at the API server. It builds Cilium, like
// TestCiliumInterop, so it runs only with IDENTITYD_CILIUM_INTEROP=1 (make
// bench-cilium-mixed).
func BenchmarkCiliumMixed(b *testing.B) {
	if os.Getenv(ciliumInteropEnv) == "" {
		b.Skipf("set %s=1 to build Cilium v1.16.2's CRD allocator and race it (make bench-cilium-mixed)", ciliumInteropEnv)
	}
	bin := ciliumBinary(b)
	const sets = 2000
	var total mixedResult
	for b.Loop() {
		r := raceMixed(b, bin, benchSets(sets))
		b.Logf("round %d: %d sets in %s; identityd nodes split on %d, %d unready; a Cilium agent answers otherwise than identityd on %d; %.3f objects/set; late identityd node %s (%.2f requests/set), late Cilium agent %s",
			total.rounds, r.sets, r.race.Round(time.Millisecond), r.split, r.unready, r.ciliumDiffer, float64(r.objects)/float64(r.sets),
			r.lateIdentityd.Round(time.Millisecond), r.lateRequests/float64(r.sets), r.lateCilium.Round(time.Millisecond))
		total.add(r)
	}
	b.ReportMetric(float64(total.split), "identityd-split-sets")
	b.ReportMetric(float64(total.unready), "identityd-unready")
	b.ReportMetric(float64(total.ciliumDiffer)/float64(total.rounds), "cilium-differ-sets/round")
	b.ReportMetric(float64(total.objects)/float64(total.sets), "objects/set")
	b.ReportMetric(total.lateIdentityd.Seconds()/float64(total.rounds), "late-identityd-s")
	b.ReportMetric(total.lateCilium.Seconds()/float64(total.rounds), "late-cilium-s")
	b.ReportMetric(total.lateIdentityd.Seconds()/total.lateCilium.Seconds(), "late-x-cilium")
	b.ReportMetric(total.lateRequests/float64(total.sets), "late-requests/set")
}

// mixedCiliumArgs are the crdnode arguments of the mixed race: 8 label sets
// at a time, and the identityd nodes' client limit.
func mixedCiliumArgs() []string {
	return []string{"-parallel", fmt.Sprint(raceGoroutines), "-timeout", "5m", "-qps", fmt.Sprint(mixedQPS), "-burst", fmt.Sprint(mixedQPS)}
}

// limitedConfig is rc with a client limited to mixedQPS requests/s, burst
// as many, as --k8s-client-qps gives the agent's clients one limiter.
func limitedConfig(rc *rest.Config) *rest.Config {
	c := rest.CopyConfig(rc)
	c.QPS, c.Burst = mixedQPS, mixedQPS
	c.RateLimiter = flowcontrol.NewTokenBucketRateLimiter(mixedQPS, mixedQPS)
	return c
}

// healthOf adds the agent's health provider to a node's hive, and keeps it
// in *p.
func healthOf(p **health.Provider) func(*nodeOpts) {
	return func(o *nodeOpts) {
		o.cells = append(o.cells, health.Cell, cell.Invoke(func(h *health.Provider) { *p = h }))
	}
}

// raceMixed runs one round of BenchmarkCiliumMixed on a server of its own.
func raceMixed(b *testing.B, bin string, sets []labels.Labels) mixedResult {
	srv := startServer(b)
	defer srv.Stop(b)
	round := benchRun.Add(1)
	host, err := url.Parse(srv.URL())
	if err != nil {
		b.Fatal(err)
	}
	slow := limitedConfig(srv.RESTConfig())
	slow.Host = "https://" + startDelayProxy(b, host.Host, mixedDelay)
	configs := []*rest.Config{limitedConfig(srv.RESTConfig()), slow}
	provs := make([]*health.Provider, len(configs))
	var nodes []*testNode
	for i, rc := range configs {
		n := startNode(b, rc, fmt.Sprintf("mixed-%d-%d", round, i), healthOf(&provs[i]))
		defer n.stop()
		n.allocate(b, warmSet(round, i))
		nodes = append(nodes, n)
	}
	var agents []*ciliumAgent
	for i := range 2 {
		a := startCilium(b, bin, srv.Kubeconfig(), mixedCiliumArgs()...)
		if ans := a.ask(warmSet(round, len(nodes)+i)); ans.err != "" || ans.id == 0 {
			b.Fatalf("crdnode %d: warm-up allocation: %+v", i, ans)
		}
		agents = append(agents, a)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	ids := make([][]identity.NumericIdentity, len(nodes))
	answers := make([]map[string]identity.NumericIdentity, len(agents))
	errs := make([]error, len(nodes)+len(agents))
	var wg sync.WaitGroup
	start := time.Now()
	for i, n := range nodes {
		wg.Go(func() { ids[i], errs[i] = allocateAll(ctx, n, sets, raceGoroutines) })
	}
	for i, a := range agents {
		wg.Go(func() { answers[i], errs[len(nodes)+i] = a.allocateAll(sets) })
	}
	wg.Wait()
	raceEnd := time.Now()
	r := mixedResult{rounds: 1, sets: len(sets), race: raceEnd.Sub(start)}
	for _, a := range agents {
		a.close()
	}
	for _, err := range errs {
		if err != nil {
			b.Fatal(err)
		}
	}
	for j, s := range sets {
		if ids[0][j] != ids[1][j] {
			r.split++
			if r.split <= 5 {
				b.Logf("split: %s: node 0 %d, node 1 (behind the proxy) %d", s, ids[0][j], ids[1][j])
			}
		}
		for _, ans := range answers {
			if ans[s.Canonical()] != ids[0][j] {
				r.ciliumDiffer++
				break
			}
		}
	}
	raced := map[string]bool{}
	for _, s := range sets {
		raced[s.Canonical()] = true
	}
	for _, o := range newClient(b, srv.RESTConfig()).identities(b) {
		if l, err := parseSecurityLabels(o.SecurityLabels); err == nil && raced[l.Canonical()] {
			r.objects++
		}
	}

	// The late identityd node, then the late Cilium agent.
	late := startNode(b, limitedConfig(srv.RESTConfig()), fmt.Sprintf("mixed-%d-late", round))
	defer late.stop()
	late.allocate(b, warmSet(round, 10))
	before := serverRequests(b, srv)
	start = time.Now()
	if _, err := allocateAll(ctx, late, sets, raceGoroutines); err != nil {
		b.Fatal(err)
	}
	r.lateIdentityd = time.Since(start)
	after := serverRequests(b, srv)
	for verb, v := range after {
		r.lateRequests += v - before[verb]
	}
	lateCilium := startCilium(b, bin, srv.Kubeconfig(), mixedCiliumArgs()...)
	if ans := lateCilium.ask(warmSet(round, 11)); ans.err != "" || ans.id == 0 {
		b.Fatalf("late crdnode: warm-up allocation: %+v", ans)
	}
	start = time.Now()
	if _, err := lateCilium.allocateAll(sets); err != nil {
		b.Fatalf("late crdnode: %v", err)
	}
	r.lateCilium = time.Since(start)
	lateCilium.close()

	// Readiness, as /readyz asks it, once the race is mixedReady behind.
	time.Sleep(time.Until(raceEnd.Add(mixedReady)))
	for i, p := range provs {
		if ok, bad := p.Healthy(); !ok {
			r.unready++
			b.Logf("identityd node %d not ready: %s", i, health.Format(bad))
		}
	}
	return r
}

// startDelayProxy forwards the TCP connections it accepts on a port of
// 127.0.0.1 to target, handing on what each side sends delay later, and
// returns its address. It stops with the benchmark.
func startDelayProxy(tb testing.TB, target string, delay time.Duration) string {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	var (
		mu    sync.Mutex
		open  []net.Conn
		conns sync.WaitGroup
	)
	tb.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range open {
			c.Close()
		}
		mu.Unlock()
		conns.Wait()
	})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns.Go(func() {
				up, err := net.Dial("tcp", target)
				if err != nil {
					c.Close()
					return
				}
				mu.Lock()
				open = append(open, c, up)
				mu.Unlock()
				go delayCopy(up, c, delay)
				delayCopy(c, up, delay)
			})
		}
	}()
	return ln.Addr().String()
}

// delayCopy writes to dst what src sends, each read delay after it
// arrived, and closes both once either side ends.
func delayCopy(dst, src net.Conn, delay time.Duration) {
	type chunk struct {
		b  []byte
		at time.Time
	}
	ch := make(chan chunk, 256)
	go func() {
		defer close(ch)
		for {
			buf := make([]byte, 32<<10)
			n, err := src.Read(buf)
			if n > 0 {
				ch <- chunk{buf[:n], time.Now().Add(delay)}
			}
			if err != nil {
				return
			}
		}
	}()
	for c := range ch {
		time.Sleep(time.Until(c.at))
		if _, err := dst.Write(c.b); err != nil {
			break
		}
	}
	dst.Close()
	src.Close()
	for range ch {
	}
}
