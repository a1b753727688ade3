package crdstore

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// benchSets returns n new label sets, unique across the benchmark's runs.
var benchRun atomic.Int64

func benchSets(n int) []labels.Labels {
	run := benchRun.Add(1)
	out := make([]labels.Labels, n)
	for i := range out {
		out[i] = labels.MustParse(fmt.Sprintf("k8s:app=bench-%d-%d", run, i), "k8s:io.kubernetes.pod.namespace=bench")
	}
	return out
}

// runAllocations allocates sets on n with goroutines workers and returns
// the time it took.
func runAllocations(b *testing.B, n *testNode, sets []labels.Labels, goroutines int) time.Duration {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	start := time.Now()
	if _, err := allocateAll(ctx, n, sets, goroutines); err != nil {
		b.Fatal(err)
	}
	return time.Since(start)
}

// BenchmarkAllocate measures new identities per second on one node, with
// the API requests each costs (the IdentityNode writes included), beside
// bare creates of CiliumIdentity objects on the same server: the physical
// limit.
func BenchmarkAllocate(b *testing.B) {
	srv := startServer(b)
	var requests atomic.Int64
	n := startNode(b, counted(srv.RESTConfig(), &requests), "bench-node")
	for _, goroutines := range []int{1, 8} {
		b.Run(fmt.Sprintf("bare-create-first/goroutines=%d", goroutines), func(b *testing.B) {
			benchBareCreate(b, newClient(b, srv.RESTConfig()), goroutines)
		})
	}
	for _, goroutines := range []int{1, 8} {
		b.Run(fmt.Sprintf("goroutines=%d", goroutines), func(b *testing.B) {
			var total time.Duration
			var count int
			req0 := requests.Load()
			for b.Loop() {
				sets := benchSets(200)
				total += runAllocations(b, n, sets, goroutines)
				count += len(sets)
			}
			b.ReportMetric(float64(count)/total.Seconds(), "identities/s")
			b.ReportMetric(float64(requests.Load()-req0)/float64(count), "requests/identity")
		})
	}
	for _, goroutines := range []int{1, 8} {
		b.Run(fmt.Sprintf("bare-create/goroutines=%d", goroutines), func(b *testing.B) {
			benchBareCreate(b, newClient(b, srv.RESTConfig()), goroutines)
		})
	}
}

// benchBareCreate creates CiliumIdentity objects as fast as goroutines
// workers can, with no cache, no placement and no IdentityNode.
func benchBareCreate(b *testing.B, cli *client, goroutines int) {
	var next atomic.Uint32
	next.Store(uint32(40000 + 4000*benchRun.Add(1)%20000))
	var total time.Duration
	count := 0
	for b.Loop() {
		const per = 200
		var wg sync.WaitGroup
		var failed atomic.Value
		work := make(chan int, per)
		for i := range per {
			work <- i
		}
		close(work)
		start := time.Now()
		for range goroutines {
			wg.Go(func() {
				for range work {
					id := identity.NumericIdentity(next.Add(1))
					// The same object as the store writes for a
					// label set of the same shape.
					lbls := labels.MustParse(fmt.Sprintf("k8s:app=bare-%d", id), "k8s:io.kubernetes.pod.namespace=bench")
					obj := newIdentityObject(id, lbls)
					// An ID the other benchmarks took is skipped.
					if err := cli.cilium.Post().Resource("ciliumidentities").Body(obj).Do(context.Background()).Error(); err != nil && !apierrors.IsAlreadyExists(err) {
						failed.Store(err)
					}
				}
			})
		}
		wg.Wait()
		total += time.Since(start)
		count += per
		if err, _ := failed.Load().(error); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(count)/total.Seconds(), "identities/s")
}

// BenchmarkThreeNodes has 3 nodes allocate the same label sets at 8
// goroutines each: distinct identities per second, and the duplicates
// (objects beyond one per label set, which must be 0).
func BenchmarkThreeNodes(b *testing.B) {
	srv := startServer(b)
	var requests atomic.Int64
	var ns []*testNode
	for i := range 3 {
		ns = append(ns, startNode(b, counted(srv.RESTConfig(), &requests), fmt.Sprintf("bench-%d", i)))
	}
	cli := newClient(b, srv.RESTConfig())
	var total time.Duration
	count := 0
	req0 := requests.Load()
	for b.Loop() {
		sets := benchSets(300)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		var wg sync.WaitGroup
		errs := make([]error, len(ns))
		start := time.Now()
		for i, n := range ns {
			wg.Go(func() { _, errs[i] = allocateAll(ctx, n, sets, 8) })
		}
		wg.Wait()
		total += time.Since(start)
		cancel()
		for _, err := range errs {
			if err != nil {
				b.Fatal(err)
			}
		}
		count += len(sets)
	}
	objs := len(cli.identities(b))
	b.ReportMetric(float64(count)/total.Seconds(), "identities/s")
	b.ReportMetric(float64(requests.Load()-req0)/float64(count), "requests/identity")
	b.ReportMetric(float64(objs-count), "duplicates")
	var reads uint64
	for _, n := range ns {
		reads += n.store.stats.reads.Load()
	}
	b.ReportMetric(float64(reads)/float64(count), "reads/identity")
}

// BenchmarkThreeNodesAfterStopped races 3 nodes on 2,000 new label sets (8
// goroutines each, the same sets in the same order) on a fresh API server:
// stopped=0 alone, stopped=6 after 6 other nodes have run and stopped
// cleanly (Stop, what SIGTERM does), whose IdentityNode records stay until
// their lease ends. The racers must order their creates among themselves,
// not wait for nodes that are gone. It reports distinct identities per
// second, the API requests per identity and the duplicates (objects beyond
// one per label set, which must be 0).
func BenchmarkThreeNodesAfterStopped(b *testing.B) {
	for _, stopped := range []int{0, 6} {
		b.Run(fmt.Sprintf("stopped=%d", stopped), func(b *testing.B) {
			var total time.Duration
			var count, objs int
			var requests int64
			for b.Loop() {
				r := raceAfterStopped(b, stopped, benchSets(2000))
				total += r.elapsed
				count += r.sets
				objs += r.objects
				requests += r.requests
			}
			b.ReportMetric(float64(count)/total.Seconds(), "identities/s")
			b.ReportMetric(float64(requests)/float64(count), "requests/identity")
			b.ReportMetric(float64(objs-count), "duplicates")
		})
	}
}

// stoppedRace is one race of BenchmarkThreeNodesAfterStopped.
type stoppedRace struct {
	sets, objects int
	requests      int64
	elapsed       time.Duration
}

// raceAfterStopped starts a server, runs and stops stopped nodes on it,
// then races 3 nodes on sets.
func raceAfterStopped(b *testing.B, stopped int, sets []labels.Labels) stoppedRace {
	srv := startServer(b)
	defer srv.Stop(b)
	round := benchRun.Add(1)
	for i := range stopped {
		n := startNode(b, srv.RESTConfig(), fmt.Sprintf("gone-%d-%d", round, i))
		n.allocate(b, warmSet(round, 100+i))
		n.stop()
	}
	var requests atomic.Int64
	var ns []*testNode
	for i := range 3 {
		n := startNode(b, counted(srv.RESTConfig(), &requests), fmt.Sprintf("racer-%d-%d", round, i))
		defer n.stop()
		n.allocate(b, warmSet(round, i))
		ns = append(ns, n)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	errs := make([]error, len(ns))
	var wg sync.WaitGroup
	req0 := requests.Load()
	start := time.Now()
	for i, n := range ns {
		wg.Go(func() { _, errs[i] = allocateAll(ctx, n, sets, 8) })
	}
	wg.Wait()
	elapsed := time.Since(start)
	for _, err := range errs {
		if err != nil {
			b.Fatal(err)
		}
	}
	warm := stopped + len(ns)
	return stoppedRace{
		sets: len(sets), elapsed: elapsed, requests: requests.Load() - req0,
		objects: len(newClient(b, srv.RESTConfig()).identities(b)) - warm,
	}
}
