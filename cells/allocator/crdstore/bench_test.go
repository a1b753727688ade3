package crdstore

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

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
					lbls := labels.MustParse(fmt.Sprintf("k8s:app=bare-%d", id))
					obj := &CiliumIdentity{ObjectMeta: metav1.ObjectMeta{Name: id.String()}, SecurityLabels: securityLabels(lbls)}
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
