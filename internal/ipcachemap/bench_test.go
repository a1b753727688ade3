package ipcachemap

import (
	"runtime"
	"testing"
)

func totalAlloc() uint64 {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.TotalAlloc
}

// benchOpen opens a fresh map of the named backend for a benchmark.
func benchOpen(b *testing.B, kind string, maxEntries uint32) Map {
	b.Helper()
	switch kind {
	case "bpf":
		m, _ := openTestBPF(b, Config{MaxEntries: maxEntries})
		return m
	default:
		m, _, err := Open(Config{Kind: KindFile, FilePath: tempFilePath(b), MaxEntries: maxEntries})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { m.Close() })
		return m
	}
}

// alternating returns two versions of n entries with the same keys and
// different identities, so that every round really changes every value.
func alternating(n int) [2][]Entry {
	a := testEntries(n)
	c := make([]Entry, n)
	copy(c, a)
	for i := range c {
		c[i].Value.Identity++
	}
	return [2][]Entry{a, c}
}

// BenchmarkUpdate writes 100,000 entries per op: one UpdateBatch call, or
// one Update call per entry. For file, the op ends with Sync (the write to
// disk the reconciler pays per round).
func BenchmarkUpdate(b *testing.B) {
	const n = 100_000
	sets := alternating(n)
	for _, kind := range []string{"bpf", "file"} {
		for _, mode := range []string{"batch", "single"} {
			b.Run(kind+"/"+mode, func(b *testing.B) {
				m := benchOpen(b, kind, n)
				round := 0
				for b.Loop() {
					set := sets[round%2]
					round++
					if mode == "batch" {
						if err := m.UpdateBatch(set); err != nil {
							b.Fatal(err)
						}
					} else {
						for _, e := range set {
							if err := m.Update(e.Key, e.Value); err != nil {
								b.Fatal(err)
							}
						}
					}
					if err := m.Sync(); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(n*round)/b.Elapsed().Seconds(), "entries/s")
			})
		}
	}
}

// BenchmarkSnapshot reads a 100,000-entry map into []Entry, as Open does.
func BenchmarkSnapshot(b *testing.B) {
	const n = 100_000
	entries := testEntries(n)
	for _, kind := range []string{"bpf", "file"} {
		b.Run(kind, func(b *testing.B) {
			benchSnapshot(b, benchOpen(b, kind, n), entries)
		})
	}
}

// BenchmarkBPF1M fills a map sized for 1,000,000 prefixes (the identityd
// target; Cilium's is fixed at 512k) and snapshots it. kernel-B/entry is
// the kernel's memory accounting for the trie (fdinfo memlock).
func BenchmarkBPF1M(b *testing.B) {
	const n = 1_000_000
	entries := testEntries(n)
	b.Run("fill", func(b *testing.B) {
		requireBPF(b)
		rounds := 0
		var kernelPerEntry float64
		for b.Loop() {
			m := benchOpen(b, "bpf", n)
			if err := m.UpdateBatch(entries); err != nil {
				b.Fatal(err)
			}
			if ml, ok := memlock(m); ok {
				kernelPerEntry = float64(ml) / n
			}
			m.Close()
			rounds++
		}
		b.ReportMetric(float64(n*rounds)/b.Elapsed().Seconds(), "entries/s")
		b.ReportMetric(kernelPerEntry, "kernel-B/entry")
	})
	b.Run("snapshot", func(b *testing.B) {
		benchSnapshot(b, benchOpen(b, "bpf", n), entries)
	})
}

// benchSnapshot fills m with entries and measures Snapshot of it.
func benchSnapshot(b *testing.B, m Map, entries []Entry) {
	n := len(entries)
	if err := m.UpdateBatch(entries); err != nil {
		b.Fatal(err)
	}
	rounds := 0
	before := totalAlloc()
	for b.Loop() {
		got, err := Snapshot(m)
		if err != nil || len(got) != n {
			b.Fatalf("snapshot: %d entries, %v", len(got), err)
		}
		rounds++
	}
	b.ReportMetric(float64(n*rounds)/b.Elapsed().Seconds(), "entries/s")
	b.ReportMetric(float64(totalAlloc()-before)/float64(n*rounds), "alloc-B/entry")
}
