package crdstore

import (
	"context"
	"fmt"
	"io"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"

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
