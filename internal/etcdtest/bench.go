package etcdtest

import (
	"context"
	"fmt"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// RawTxn runs the reference conditional transaction that identity
// allocation is measured against: if key a does not exist yet
// (CreateRevision == 0), create a and b. It fails if the compare failed.
func RawTxn(ctx context.Context, cli *clientv3.Client, a, b, value string) error {
	resp, err := cli.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(a), "=", 0)).
		Then(clientv3.OpPut(a, value), clientv3.OpPut(b, value)).
		Commit()
	if err != nil {
		return err
	}
	if !resp.Succeeded {
		return fmt.Errorf("etcdtest: txn compare failed: %s exists", a)
	}
	return nil
}

// BenchRawTxn measures RawTxn on fresh keys under prefix with the given
// number of concurrent goroutines (1 = sequential) and reports "txn/s".
// Other benchmarks compare their rates with this one on the same server.
func BenchRawTxn(b *testing.B, cli *clientv3.Client, prefix string, goroutines int) {
	b.Helper()
	ctx := b.Context()
	// The benchmark function may run several times with growing b.N: keys
	// must be fresh for each run, and the rate is of this run alone.
	prefix = prefix + "/" + strconv.FormatInt(time.Now().UnixNano(), 36)
	var seq atomic.Uint64
	op := func() {
		n := strconv.FormatUint(seq.Add(1), 10)
		if err := RawTxn(ctx, cli, prefix+"/a/"+n, prefix+"/b/"+n, n); err != nil {
			b.Error(err)
		}
	}
	elapsed := RunOps(b, goroutines, op)
	if n := seq.Load(); n > 0 && elapsed > 0 {
		b.ReportMetric(float64(n)/elapsed.Seconds(), "txn/s")
	}
}

// RunOps calls op b.N times, from the given number of goroutines (1 =
// sequentially, with b.Loop), and returns the time the calls took.
func RunOps(b *testing.B, goroutines int, op func()) time.Duration {
	b.Helper()
	start := time.Now()
	if goroutines <= 1 {
		for b.Loop() {
			op()
		}
		return time.Since(start)
	}
	// RunParallel starts parallelism*GOMAXPROCS goroutines: round up so
	// that at least the asked number run.
	procs := runtime.GOMAXPROCS(0)
	b.SetParallelism((goroutines + procs - 1) / procs)
	b.ResetTimer()
	start = time.Now()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			op()
		}
	})
	return time.Since(start)
}
