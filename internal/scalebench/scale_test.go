package scalebench

import (
	"bytes"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// benchEnv must be 1 for BenchmarkScale to run: the sweep takes an hour
// or more, which `make bench` (-bench . over every package) must not.
const benchEnv = "IDENTITYD_BENCH_SCALE"

// BenchmarkScale runs the sweep of the SCALE_* variables (see the package
// documentation) once, whatever b.N is: run it with -benchtime 1x and
// IDENTITYD_BENCH_SCALE=1 (make bench-scale). It prints every run as it
// ends, then each mode's rates by N and the extrapolation.
func BenchmarkScale(b *testing.B) {
	if os.Getenv(benchEnv) != "1" {
		b.Skip("the cluster scale sweep runs with " + benchEnv + "=1 (make bench-scale)")
	}
	cfg, err := loadConfig()
	if err != nil {
		b.Fatal(err)
	}
	out := io.Writer(os.Stdout)
	if paths := os.Getenv("SCALE_LOAD"); paths != "" {
		results, cfg, err := loadRecords(paths, cfg)
		if err != nil {
			b.Fatal(err)
		}
		fmt.Fprintf(out, "cluster scale, runs saved in %s: %d identities per node (%d shared), churn %.3g changes/s per node, GC every %s\n",
			paths, cfg.identities, cfg.shared, cfg.churn, cfg.gcInterval)
		report(out, results, cfg)
		return
	}
	save := os.Getenv("SCALE_SAVE")
	fmt.Fprintf(out, "cluster scale: modes %v, nodes %v, %d identities per node (%d shared), windows of %s, churn %.3g changes/s per node, GC every %s\n",
		cfg.modes, cfg.nodes, cfg.identities, cfg.shared, cfg.window, cfg.churn, cfg.gcInterval)
	results := map[string][]*result{}
	for _, mode := range cfg.modes {
		for _, n := range cfg.nodes {
			b.Run(fmt.Sprintf("%s/N=%d", mode, n), func(b *testing.B) {
				for range b.N {
					r, err := runOne(b, mode, n, cfg, out)
					if err != nil {
						b.Fatalf("%s mode, %d nodes: %v", mode, n, err)
					}
					results[mode] = append(results[mode], r)
					if save != "" {
						if err := saveRecord(save, r, cfg); err != nil {
							b.Errorf("saving the run to %s: %v", save, err)
						}
					}
					b.ReportMetric(r.steady.byClass[classRefs].requests/r.steady.secs, "steady-refs-req/s")
					b.ReportMetric(r.steady.byClass[classRefs].sent/r.steady.secs, "steady-refs-sentB/s")
					b.ReportMetric(r.churn.byClass[classEvents].events/r.churn.secs, "churn-events/s")
				}
			})
		}
	}
	report(out, results, cfg)
}

// report prints each mode's rates by N, then each mode's extrapolation.
func report(out io.Writer, results map[string][]*result, cfg config) {
	for _, mode := range cfg.modes {
		printSummary(out, mode, onePerN(results[mode]), cfg)
	}
	for _, mode := range cfg.modes {
		printExtrapolation(out, mode, onePerN(results[mode]), cfg)
	}
}

// onePerN keeps the last result of each node count (a sub-benchmark may
// run more than once; a later saved run replaces an earlier one), by N.
func onePerN(rs []*result) []*result {
	byN := map[int]*result{}
	for _, r := range rs {
		byN[r.nodes] = r
	}
	out := make([]*result, 0, len(byN))
	for _, n := range slices.Sorted(maps.Keys(byN)) {
		out = append(out, byN[n])
	}
	return out
}

// TestScaleSmoke runs both modes with two nodes for a few seconds: the
// counters move, every class is attributed, and the report prints.
func TestScaleSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("starts etcd and an API server")
	}
	cfg := config{
		nodes: []int{2}, modes: []string{modeEtcd, modeCRD},
		identities: 4, shared: 1,
		window: 2 * time.Second, churn: 2, gcInterval: 500 * time.Millisecond, warmup: time.Second, settle: time.Second,
	}
	var out bytes.Buffer
	saved := filepath.Join(t.TempDir(), "runs.jsonl")
	for _, mode := range cfg.modes {
		r, err := runOne(t, mode, 2, cfg, &out)
		if err != nil {
			t.Fatalf("%s: %v", mode, err)
		}
		if err := saveRecord(saved, r, cfg); err != nil {
			t.Fatal(err)
		}
		if r.churn.changes == 0 || r.failed > 0 {
			t.Errorf("%s: %v changes in the churn window, %d failed", mode, r.churn.changes, r.failed)
		}
		refs, events := r.churn.byClass[classRefs], r.churn.byClass[classEvents]
		if refs.requests == 0 || refs.sent == 0 || events.events == 0 || events.sent == 0 {
			t.Errorf("%s: churn window's counters did not move: refs+GC %+v, events %+v", mode, refs, events)
		}
		if mode == modeCRD {
			// The answers to writes are counted by the nodes, not
			// estimated.
			for _, row := range r.churn.rows {
				verb, _, _ := strings.Cut(row.kind, " ")
				if writeVerbs[verb] && row.requests > 0 && (row.sent == 0 || row.sentEst) {
					t.Errorf("crd: %s: %v requests, answers %v bytes, estimated %v; want counted", row.kind, row.requests, row.sent, row.sentEst)
				}
			}
		}
		if r.steady.gc.runs == 0 || r.steady.collectors == 0 || r.gcPer.requests == 0 {
			t.Errorf("%s: no collection counted in the steady window: %+v, %d collectors, per run %+v", mode, r.steady.gc, r.steady.collectors, r.gcPer)
		}
		printExtrapolation(&out, mode, []*result{r, r}, cfg)
	}
	// The saved runs print again.
	results, loaded, err := loadRecords(saved, config{})
	if err != nil {
		t.Fatal(err)
	}
	if len(loaded.modes) != 2 || loaded.identities != cfg.identities || len(results[modeCRD]) != 1 {
		t.Errorf("loaded %v of %+v", results, loaded)
	}
	report(&out, results, loaded)
	text := out.String()
	for _, want := range []string{"== etcd mode, N=2", "== crd mode, N=2", "Txn", "POST ciliumidentities", "identitynodes",
		"== etcd mode: rates at the server by N", "== crd mode: rates at the server by N", "against one collector's GC"} {
		if !strings.Contains(text, want) {
			t.Errorf("report lacks %q", want)
		}
	}
	if t.Failed() || testing.Verbose() {
		t.Log("\n" + text)
	}
}
