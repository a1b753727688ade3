package etcdstore

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/labels"
)

// opRate runs op with the given concurrency for about d, each call with a
// new sequence number, and returns calls/s. It stops at the first error.
func opRate(b *testing.B, d time.Duration, goroutines int, op func(seq int64) error) float64 {
	b.Helper()
	var seq atomic.Int64
	start := time.Now()
	deadline := start.Add(d)
	var wg sync.WaitGroup
	for range goroutines {
		wg.Go(func() {
			for time.Now().Before(deadline) {
				if err := op(seq.Add(1)); err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	return float64(seq.Load()) / time.Since(start).Seconds()
}

// rawRate runs reference transactions for about d (one conditional txn writing two
// keys, etcdtest.RawTxn) with the given concurrency and returns txn/s. It
// runs in the same benchmark as the allocations it is compared with, on the
// same server, so the ratio does not depend on the machine.
func rawRate(b *testing.B, cli *clientv3.Client, d time.Duration, goroutines int) float64 {
	b.Helper()
	prefix := "bench-raw/" + strconv.FormatInt(time.Now().UnixNano(), 36)
	return opRate(b, d, goroutines, func(i int64) error {
		s := strconv.FormatInt(i, 10)
		return etcdtest.RawTxn(b.Context(), cli, prefix+"/a/"+s, prefix+"/b/"+s, s)
	})
}

// shapeRate is rawRate for the allocator's own create transaction
// (createTxn: three compares, two puts, one on a lease, two reads in the
// failure branch) on keys as long as the allocator's, under a prefix of its
// own, with a watcher draining its master keys as the allocator's cache
// does. It tells what the transaction and the watch cost without any
// allocator around them: the ceiling of the allocator's rate.
func shapeRate(b *testing.B, cli *clientv3.Client, d time.Duration, goroutines int) float64 {
	b.Helper()
	prefix := "bench-shape/" + strconv.FormatInt(time.Now().UnixNano(), 36)
	prefix += strings.Repeat("x", max(0, len(IdentitiesPrefix)-len(prefix)))
	lease, err := cli.Grant(b.Context(), 600)
	if err != nil {
		b.Fatal(err)
	}
	wctx, cancel := context.WithCancel(b.Context())
	defer cancel()
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		for range cli.Watch(wctx, prefix+"/id/", clientv3.WithPrefix()) {
		}
	}()
	rate := opRate(b, d, goroutines, func(i int64) error {
		id := strconv.FormatInt(256+i, 10)
		value := "k8s:app=shape-" + id + ";"
		resp, err := commitTxn(b.Context(), cli, createTxn(prefix+"/id/"+id,
			prefix+"/value/"+value+"/", prefix+"/locks/"+value+"/", "bench", value, id, lease.ID, 0))
		if err == nil && !resp.Succeeded {
			err = fmt.Errorf("shape transaction for %s failed its compares", id)
		}
		return err
	})
	cancel()
	<-watched
	return rate
}

// BenchmarkEtcdNewIdentity measures new global identities per second through
// the allocator against a real etcd process, and their ratio to raw
// conditional transactions measured in the same run ("x-raw"; the target is
// at least 0.8), and to the allocator's own transaction issued by a bare
// loop ("x-shape", see shapeRate).
//
// The three are measured in interleaved slices (etcdRounds rounds of one
// slice each, in rotating order), so that the server's drift during a run,
// which on a small shared machine moves its rate by a tenth within
// seconds, falls on all three alike instead of on whichever ran at the
// time. A run takes about 9 s per setting whatever -benchtime says.
func BenchmarkEtcdNewIdentity(b *testing.B) {
	c := etcdtest.StartSingle(b)
	cli := c.Client(b)
	n := startEtcdNode(b, c, "bench")
	rawRate(b, cli, 200*time.Millisecond, 8) // warm the server up
	cpu := cpuClock{serverPID: c.Member(0).PID()}
	run := 0
	for _, goroutines := range []int{1, 8} {
		b.Run("goroutines="+strconv.Itoa(goroutines), func(b *testing.B) {
			run++
			prefix := "k8s:app=bench" + strconv.Itoa(run) + "-"
			var seq atomic.Int64
			alloc := func(int64) error {
				l := labels.MustParse(prefix + strconv.FormatInt(seq.Add(1), 10))
				if _, allocated, err := n.alloc.Allocate(b.Context(), l); err != nil || !allocated {
					return fmt.Errorf("allocation: allocated %v, err %v", allocated, err)
				}
				return nil
			}
			txns := n.txns()
			var rawCPU, shapeCPU, allocCPU cpuUse
			phases := []struct {
				use *cpuUse
				run func() float64
			}{
				{&rawCPU, func() float64 { return rawRate(b, cli, etcdSlice, goroutines) }},
				{&shapeCPU, func() float64 { return shapeRate(b, cli, etcdSlice, goroutines) }},
				{&allocCPU, func() float64 { return opRate(b, etcdSlice, goroutines, alloc) }},
			}
			for round := range etcdRounds {
				for i := range phases {
					p := phases[(round+i)%len(phases)]
					p.use.measure(cpu, p.run)
				}
			}
			done := seq.Load()
			b.StopTimer()
			defer releaseAll(b, n, cli, prefix, done)
			raw, shape, rate := rawCPU.rate(), shapeCPU.rate(), allocCPU.rate()
			b.ReportMetric(rate, "identities/s")
			b.ReportMetric(raw, "raw-txn/s")
			b.ReportMetric(rate/raw, "x-raw")
			b.ReportMetric(shape, "shape-txn/s")
			b.ReportMetric(rate/shape, "x-shape")
			b.ReportMetric(shape/raw, "shape-x-raw")
			rawCPU.report(b, "raw-")
			shapeCPU.report(b, "shape-")
			allocCPU.report(b, "")
			b.ReportMetric(float64(n.txns()-txns)/float64(done), "txn/op")
		})
	}
}

// etcdRounds and etcdSlice shape BenchmarkEtcdNewIdentity's interleaving:
// 3 s of each phase in all.
const (
	etcdRounds = 6
	etcdSlice  = 500 * time.Millisecond
)

// cpuClock reads the CPU time (user and system) used so far by this
// process and by the etcd server.
type cpuClock struct{ serverPID int }

// now returns both; ok is false where /proc/<pid>/stat cannot be read.
func (c cpuClock) now() (client, server time.Duration, ok bool) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, 0, false
	}
	client = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	stat, err := os.ReadFile("/proc/" + strconv.Itoa(c.serverPID) + "/stat")
	if err != nil {
		return 0, 0, false
	}
	// utime and stime are the 12th and 13th fields after the command
	// name, which is in parentheses and may hold spaces.
	_, rest, _ := bytes.Cut(stat, []byte(") "))
	fields := strings.Fields(string(rest))
	if len(fields) < 13 {
		return 0, 0, false
	}
	utime, err1 := strconv.ParseInt(fields[11], 10, 64)
	stime, err2 := strconv.ParseInt(fields[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, 0, false
	}
	// In clock ticks, 100 per second on Linux (USER_HZ).
	return client, time.Duration(utime+stime) * 10 * time.Millisecond, true
}

// cpuUse adds up the CPU time a phase of a benchmark cost the benchmark
// process ("client": the allocator, its kvstore client and the benchmark
// loop) and the etcd server, and the operations it did.
type cpuUse struct {
	client, server time.Duration
	ops            float64
	elapsed        time.Duration
	failed         bool
}

// rate is the operations per second over all the measured calls.
func (u *cpuUse) rate() float64 {
	if u.elapsed <= 0 {
		return 0
	}
	return u.ops / u.elapsed.Seconds()
}

// measure runs f, which does operations for a while and returns their rate
// per second, and adds the operations, the time and what they cost.
func (u *cpuUse) measure(clock cpuClock, f func() float64) {
	c0, s0, ok0 := clock.now()
	start := time.Now()
	rate := f()
	elapsed := time.Since(start)
	c1, s1, ok1 := clock.now()
	u.ops += rate * elapsed.Seconds()
	u.elapsed += elapsed
	if !ok0 || !ok1 {
		u.failed = true
		return
	}
	u.client += c1 - c0
	u.server += s1 - s0
}

// report reports the CPU microseconds per operation on both sides, which
// tell where a gap to the raw rate comes from better than the rates do:
// on 2 cores the server and the client take CPU from each other.
func (u *cpuUse) report(b *testing.B, prefix string) {
	if u.failed || u.ops == 0 {
		return
	}
	b.ReportMetric(float64(u.client.Microseconds())/u.ops, prefix+"client-us/op")
	b.ReportMetric(float64(u.server.Microseconds())/u.ops, prefix+"server-us/op")
}

// releaseAll releases the identities a benchmark run allocated (label
// sets prefix+1 to prefix+n) and deletes their master keys, so that runs
// repeated with -count do not run out of the 65,280 global IDs.
func releaseAll(b *testing.B, n *etcdNode, cli *clientv3.Client, prefix string, count int64) {
	b.Helper()
	for i := int64(1); i <= count; i++ {
		id := n.alloc.LookupByLabels(labels.MustParse(prefix + strconv.FormatInt(i, 10)))
		if id == nil {
			continue
		}
		if _, err := n.alloc.Release(b.Context(), id); err != nil {
			b.Fatal(err)
		}
	}
	// Nothing holds them now: delete the master keys at once instead of
	// waiting for the rate-limited GC.
	if _, err := cli.Delete(b.Context(), MasterKeyPrefix, clientv3.WithPrefix()); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkEtcdThreeNodes measures three nodes (separate hives and clients)
// allocating the same label sets at once: each op is a batch of label sets
// that every node allocates with 8 goroutines, and identities/s counts each
// set once.
func BenchmarkEtcdThreeNodes(b *testing.B) {
	const batch = 200
	c := etcdtest.StartSingle(b)
	var nodes []*etcdNode
	for i := range 3 {
		nodes = append(nodes, startEtcdNode(b, c, "bench"+strconv.Itoa(i)))
	}
	run := 0
	sets := 0
	var elapsed time.Duration
	for b.Loop() {
		run++
		all := make([]labels.Labels, batch)
		for i := range all {
			all[i] = labels.MustParse("k8s:app=three"+strconv.Itoa(run)+"-"+strconv.Itoa(i), "k8s:io.kubernetes.pod.namespace=bench")
		}
		ctx, cancel := context.WithTimeout(b.Context(), time.Minute)
		start := time.Now()
		var wg sync.WaitGroup
		for ni, n := range nodes {
			for g := range 8 {
				wg.Go(func() {
					for k := g; k < batch; k += 8 {
						i := (k + ni*batch/3) % batch
						if _, _, err := n.alloc.Allocate(ctx, all[i]); err != nil {
							b.Error(err)
							return
						}
					}
				})
			}
		}
		wg.Wait()
		elapsed += time.Since(start)
		cancel()
		sets += batch
	}
	b.ReportMetric(float64(sets)/elapsed.Seconds(), "identities/s")
}
