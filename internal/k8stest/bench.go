package k8stest

import (
	"sync"
	"sync/atomic"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"

	"github.com/identityd/identityd/internal/etcdtest"
)

// Sequence numbers of BenchCreate per server and resource: the benchmark
// function runs several times with growing b.N, and every object it
// creates must be new.
var (
	benchSeqMu sync.Mutex
	benchSeq   = map[string]*atomic.Uint64{}
)

// BenchCreate measures bare Create calls of new cluster-scoped objects of
// gvr, the physical limit that allocation on this server is measured
// against, from the given number of goroutines (1 = sequential) over one
// client, and reports "create/s". newObject(n) returns the n-th object;
// n counts from 1 over all BenchCreate runs on the same server and resource
// in this process, so that names made from n are fresh.
func BenchCreate(b *testing.B, cfg *rest.Config, gvr schema.GroupVersionResource, newObject func(n uint64) *unstructured.Unstructured, goroutines int) {
	b.Helper()
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		b.Fatal(err)
	}
	res := dyn.Resource(gvr)
	benchSeqMu.Lock()
	key := cfg.Host + " " + gvr.String()
	seq := benchSeq[key]
	if seq == nil {
		seq = new(atomic.Uint64)
		benchSeq[key] = seq
	}
	benchSeqMu.Unlock()

	ctx := b.Context()
	var created atomic.Uint64
	op := func() {
		if _, err := res.Create(ctx, newObject(seq.Add(1)), metav1.CreateOptions{}); err != nil {
			b.Error(err)
			return
		}
		created.Add(1)
	}
	elapsed := etcdtest.RunOps(b, goroutines, op)
	if n := created.Load(); n > 0 && elapsed > 0 {
		b.ReportMetric(float64(n)/elapsed.Seconds(), "create/s")
	}
}
