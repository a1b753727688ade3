package checkpoint

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/labels"
)

// The figures of Cilium v1.16.2 on this machine for 100,000 CIDR
// identities: 195 ms to write a 13.3 MB file, about 350 ms to decode it.

const benchIdentities = 100_000

func BenchmarkWrite(b *testing.B) {
	ids := cidrIdentities(benchIdentities)
	path := filepath.Join(b.TempDir(), FileName)
	var buf []byte
	var total time.Duration
	for b.Loop() {
		t0 := time.Now()
		buf = AppendJSON(buf[:0], ids)
		if err := WriteFile(path, buf); err != nil {
			b.Fatal(err)
		}
		total += time.Since(t0)
	}
	b.ReportMetric(float64(total.Microseconds())/1000/float64(b.N), "ms/op")
	b.ReportMetric(float64(len(buf)), "file-bytes")
	b.ReportMetric(float64(len(buf))/benchIdentities, "bytes/identity")
}

func BenchmarkEncode(b *testing.B) {
	ids := cidrIdentities(benchIdentities)
	var buf []byte
	for b.Loop() {
		buf = AppendJSON(buf[:0], ids)
	}
	b.SetBytes(int64(len(buf)))
	b.ReportMetric(float64(b.Elapsed().Microseconds())/1000/float64(b.N), "ms/op")
}

func BenchmarkLoad(b *testing.B) {
	ids := cidrIdentities(benchIdentities)
	path := filepath.Join(b.TempDir(), FileName)
	if err := WriteFile(path, AppendJSON(nil, ids)); err != nil {
		b.Fatal(err)
	}
	fi, _ := os.Stat(path)
	for b.Loop() {
		res, err := Loader{}.Load(path)
		if err != nil || res.Report.Valid != benchIdentities {
			b.Fatalf("load: %v, %d valid", err, res.Report.Valid)
		}
	}
	b.SetBytes(fi.Size())
	b.ReportMetric(float64(b.Elapsed().Microseconds())/1000/float64(b.N), "ms/op")
	b.ReportMetric(float64(fi.Size()), "file-bytes")
}

func BenchmarkDecode(b *testing.B) {
	data := AppendJSON(nil, cidrIdentities(benchIdentities))
	for b.Loop() {
		ids, invalid, err := Decode(data)
		if err != nil || len(invalid) != 0 || len(ids) != benchIdentities {
			b.Fatal(err, len(invalid), len(ids))
		}
	}
	b.SetBytes(int64(len(data)))
	b.ReportMetric(float64(b.Elapsed().Microseconds())/1000/float64(b.N), "ms/op")
}

// BenchmarkDurableAllocate measures one caller's durable answer of a local
// identity, as identity/allocate gives it (Allocate, then SyncIdentities),
// with 1k, 10k and 100k local identities already held and the checkpoint
// written, at the default --identity-checkpoint-interval: "new" allocates
// a label set per operation (one journal record and fsync), "held" one the
// node holds already (no write), and "whole" a new label set made durable
// by Sync, the rewrite of the whole checkpoint that identity/allocate
// waited for before the journal. p50-µs and p99-µs are the latencies of
// single operations.
func BenchmarkDurableAllocate(b *testing.B) {
	for _, n := range []int{1_000, 10_000, 100_000} {
		for _, form := range []string{"new", "held", "whole"} {
			b.Run(fmt.Sprintf("existing=%d/%s", n, form), func(b *testing.B) { benchDurableAllocate(b, n, form) })
		}
	}
}

func benchDurableAllocate(b *testing.B, n int, form string) {
	held := form == "held"
	_, cp, alloc := syncHiveEvery(b, b.TempDir(), DefaultConfig.IdentityCheckpointInterval)
	ctx := context.Background()
	reqs := make([]allocator.Request, n)
	for i := range reqs {
		reqs[i].Labels = benchCIDR(i)
	}
	for _, r := range alloc.AllocateBatch(ctx, reqs) {
		if r.Err != nil {
			b.Fatal(r.Err)
		}
	}
	if _, err := cp.Write(); err != nil {
		b.Fatal(err)
	}
	lat := make([]time.Duration, 0, 1024)
	i := n
	for b.Loop() {
		lbls := benchCIDR(i)
		if held {
			lbls = benchCIDR(i % n)
		}
		i++
		t0 := time.Now()
		id, _, err := alloc.Allocate(ctx, lbls)
		if err != nil {
			b.Fatal(err)
		}
		sync := func() error { return cp.SyncIdentities(ctx, id) }
		if form == "whole" {
			sync = func() error { return cp.Sync(ctx) }
		}
		if err := sync(); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(t0))
	}
	reportLatencies(b, lat)
}

// benchCIDR is the label set of the i-th /32 of 10.0.0.0/8.
func benchCIDR(i int) labels.Labels {
	return labels.FromPrefix(netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}), 32), false)
}

// reportLatencies reports the median and 99th percentile of lat.
func reportLatencies(b *testing.B, lat []time.Duration) {
	slices.Sort(lat)
	if len(lat) == 0 {
		return
	}
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds())/1e3, "p50-µs")
	b.ReportMetric(float64(lat[min(len(lat)-1, len(lat)*99/100)].Nanoseconds())/1e3, "p99-µs")
}
