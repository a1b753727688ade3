// Command compare runs identityd's and Cilium's local allocator benchmarks
// in alternating processes and prints, for every round, both figures and
// their multiple, then the median and the lowest multiple per benchmark.
//
//	compare [-rounds 6] [-count 1] identityd.test cilium.test
//
// The two arguments are test binaries (go test -c) of cells/allocator and
// of this module. Each benchmark runs in a process of its own, -count
// times in it, and its figure is the median of those runs: with -count 1
// the first million new identities always meet a fresh heap, on both
// sides; with -count 3 the median is a run on a heap that earlier runs
// grew. The order of the two sides alternates from round to round.
package main

import (
	"bufio"
	"bytes"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
)

// benchmark is one benchmark of both binaries and the metric compared.
type benchmark struct {
	name      string // benchmark function, without "Benchmark"
	benchtime string
	unit      string
	// lowerIsBetter marks a figure where identityd's multiple is
	// Cilium's figure over identityd's (memory).
	lowerIsBetter bool
}

var benchmarks = []benchmark{
	{"LocalNew", "1000000x", "identities/s", false},
	{"LocalHit", "2000000x", "hits/s", false},
	{"LocalRelease", "1000000x", "releases/s", false},
	{"LocalMemory", "1x", "B/identity", true},
}

func main() {
	rounds := flag.Int("rounds", 6, "rounds of every benchmark")
	count := flag.Int("count", 1, "runs of a benchmark in each process (its median is the figure)")
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: compare [-rounds N] [-count N] identityd.test cilium.test")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() != 2 || *rounds < 1 || *count < 1 {
		flag.Usage()
		os.Exit(2)
	}
	bins := [2]string{flag.Arg(0), flag.Arg(1)}
	multiples := map[string][]float64{}
	for r := range *rounds {
		for _, bm := range benchmarks {
			var got [2]float64
			for i := range 2 {
				// Alternate which side runs first.
				side := (i + r) % 2
				v, err := run(bins[side], bm, *count)
				if err != nil {
					fmt.Fprintf(os.Stderr, "compare: %s: %v\n", bins[side], err)
					os.Exit(1)
				}
				got[side] = v
			}
			m := got[0] / got[1]
			if bm.lowerIsBetter {
				m = got[1] / got[0]
			}
			multiples[bm.name] = append(multiples[bm.name], m)
			fmt.Printf("round %d  %-13s identityd %12.1f  cilium %12.1f %-13s  x%.2f\n", r+1, bm.name, got[0], got[1], bm.unit, m)
		}
	}
	fmt.Println()
	for _, bm := range benchmarks {
		ms := slices.Clone(multiples[bm.name])
		slices.Sort(ms)
		fmt.Printf("%-13s multiple of Cilium: median x%.2f, lowest x%.2f, highest x%.2f (%d rounds)\n",
			bm.name, median(ms), ms[0], ms[len(ms)-1], len(ms))
	}
}

func median(sorted []float64) float64 {
	n := len(sorted)
	if n%2 == 1 {
		return sorted[n/2]
	}
	return (sorted[n/2-1] + sorted[n/2]) / 2
}

// run runs one benchmark of a test binary count times in one process and
// returns the median of its figures in bm.unit.
func run(bin string, bm benchmark, count int) (float64, error) {
	cmd := exec.Command(bin, "-test.run", "^$", "-test.bench", "^Benchmark"+bm.name+"$", "-test.benchtime", bm.benchtime, "-test.count", strconv.Itoa(count))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return 0, fmt.Errorf("%s: %w: %s%s", bm.name, err, out, stderr.Bytes())
	}
	vs, err := parse(out, bm)
	if err != nil {
		return 0, err
	}
	if len(vs) != count {
		return 0, fmt.Errorf("%s: %d results, want %d:\n%s", bm.name, len(vs), count, out)
	}
	slices.Sort(vs)
	return median(vs), nil
}

// parse finds the benchmark's result lines and the figure before its unit
// on each.
func parse(out []byte, bm benchmark) ([]float64, error) {
	var vs []float64
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 || !strings.HasPrefix(fields[0], "Benchmark"+bm.name+"-") {
			continue
		}
		for i := 1; i+1 < len(fields); i++ {
			if fields[i+1] == bm.unit {
				v, err := strconv.ParseFloat(fields[i], 64)
				if err != nil {
					return nil, fmt.Errorf("%s: %w", bm.name, err)
				}
				vs = append(vs, v)
				break
			}
		}
	}
	return vs, nil
}
