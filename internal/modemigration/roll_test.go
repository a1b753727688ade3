package modemigration

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/k8stest"
	"github.com/identityd/identityd/internal/robustness"
	"github.com/identityd/identityd/internal/testproc"
	"github.com/identityd/identityd/labels"
)

// defaultSets is the number of global identities in use when the roll
// starts; MODEMIGRATION_SETS changes it. `make test` runs the default;
// `make test-long`, which CI also runs, runs 2,000. Every step, kill and
// check is the same at either size; the larger one costs six times the
// CPU (the API server's label-selected lists of the migrated sets grow
// with the number of objects).
const defaultSets = 300

const nodes = 3

// The modes of the roll after the start in kvstore mode: to crd, and back.
var path = []string{
	"doublewrite-readkvstore", "doublewrite-readcrd", "crd",
	"doublewrite-readcrd", "doublewrite-readkvstore", "kvstore",
}

// convergeWithin bounds the wait, at the end of a double-write step, for
// the stores to hold the same identities: the node that restarted last
// has written its identities to the write-only store by then, so only the
// report's period and the watches are waited for.
const convergeWithin = 60 * time.Second

func setCount(t *testing.T) int {
	return testproc.CountFromEnv(t, "MODEMIGRATION_SETS", defaultSets, nodes)
}

// holders returns the nodes that hold label set i: two neighbours, and
// every tenth set all three. Every set always has a holder while one node
// restarts, so no collection may delete it, however often it runs: a set
// that loses its ID is the product's fault, not the test's.
func holders(i int) []int {
	if i%10 == 0 {
		return []int{0, 1, 2}
	}
	return []int{i % nodes, (i + 1) % nodes}
}

// TestRollingModeMigration is the process test of a cluster's move between
// the stores: 3 agents on an etcd and an API server (on an etcd of its
// own) start in kvstore mode and take 2,000 global identities, each label set held by
// two or three of them; then every node is restarted, one at a time,
// with each mode of the path to crd and back (doublewrite-readkvstore,
// doublewrite-readcrd, crd, doublewrite-readcrd, doublewrite-readkvstore,
// kvstore), one restart of each step with SIGKILL instead of SIGTERM. A
// restarted node allocates its label sets again, as its users do after a
// restart (restoration gives back local identities only). After each
// restart:
//
//   - the restarted node gets every one of its label sets with its
//     original ID, and holds them;
//   - every node answers every label set with its original ID (0
//     renumbered, `identity/list`), so the nodes agree (0 disagreements),
//     and no node gives a set two IDs;
//   - every node holds exactly its label sets.
//
// At the end of each double-write step the node that reports convergence
// publishes 0 IDs in one store only and 0 IDs with different label sets,
// and equal totals (scraped from /metrics), and `doublewrite/diff` lists
// no difference on any node.
func TestRollingModeMigration(t *testing.T) {
	if testing.Short() {
		t.Skip("runs etcd, an API server and 3 identityd processes for a minute or more")
	}
	t.Parallel()
	begin := time.Now()
	n := setCount(t)

	type buildResult struct {
		bin string
		err error
	}
	built := make(chan buildResult, 1)
	binDir := t.TempDir()
	go func() {
		bin, err := testproc.BuildAgent(binDir)
		built <- buildResult{bin, err}
	}()
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	// The API server keeps its objects in an etcd of its own, as a
	// Kubernetes cluster's control plane does beside the etcd of the
	// kvstore mode. On one etcd, every write to the kvstore moves the
	// revision the API server's consistent listings wait for its watch
	// cache to reach, and the listing a CRD-reading node makes for each
	// label set whose ID the etcd store placed (every migrated one) takes
	// several times longer: MODEMIGRATION_SHARED_ETCD=1 runs it so.
	var api *k8stest.Server
	if os.Getenv("MODEMIGRATION_SHARED_ETCD") == "1" {
		api = k8stest.Start(t, k8stest.WithEtcd(etcd.Endpoints()...))
	} else {
		api = k8stest.Start(t)
	}
	b := <-built
	if b.err != nil {
		t.Fatal(b.err)
	}
	etcdArgs := []string{"--kvstore-endpoints", strings.Join(etcd.Endpoints(), ",")}
	k8sArgs := []string{"--k8s-kubeconfig-path", api.Kubeconfig()}
	storeArgs := func(mode string) []string {
		switch mode {
		case "kvstore":
			return etcdArgs
		case "crd":
			return k8sArgs
		default:
			return append(slices.Clone(etcdArgs), k8sArgs...)
		}
	}

	sets := make([]labels.Labels, n)
	holds := make([][]labels.Labels, nodes)
	for i := range sets {
		sets[i] = labels.MustParse("k8s:app=roll-"+strconv.Itoa(i), "k8s:io.kubernetes.pod.namespace=ns-"+strconv.Itoa(i%5))
		for _, h := range holders(i) {
			holds[h] = append(holds[h], sets[i])
		}
	}

	agents := make([]*agent, nodes)
	logDir := t.TempDir()
	for i := range agents {
		name := "node-" + strconv.Itoa(i+1)
		agents[i] = &agent{t: t, name: name, dir: t.TempDir(), bin: b.bin,
			logPath: filepath.Join(logDir, name+".log"), storeArgs: storeArgs}
	}
	t.Cleanup(func() {
		for _, a := range agents {
			if a.cmd != nil {
				a.cmd.Process.Kill()
				<-a.done
			}
			if t.Failed() {
				t.Logf("log of %s:\n%s", a.name, testproc.TailFile(a.logPath, 16<<10))
				// The whole log, every incarnation's, outlives the
				// test's temporary directory.
				keep := filepath.Join(os.TempDir(), fmt.Sprintf("identityd-modemigration-%d-%s.log", begin.Unix(), a.name))
				if data, err := os.ReadFile(a.logPath); err == nil && os.WriteFile(keep, data, 0o600) == nil {
					t.Logf("full log of %s written to %s", a.name, keep)
				}
			}
		}
	})
	for _, a := range agents {
		a.start("kvstore")
	}
	t.Logf("setup: %s", time.Since(begin).Round(time.Millisecond))

	// The identities in use: each node takes its label sets, all nodes
	// at once.
	start := time.Now()
	want := make(map[string]identity.NumericIdentity, n)
	got := make([]map[string]identity.NumericIdentity, nodes)
	errs := make([]error, nodes)
	var wg sync.WaitGroup
	for i, a := range agents {
		wg.Go(func() { got[i], errs[i] = a.allocateAll(holds[i]) })
	}
	wg.Wait()
	for i := range agents {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		for c, id := range got[i] {
			if old, ok := want[c]; ok && old != id {
				t.Fatalf("%s got %d for %s, another node %d", agents[i].name, id, c, old)
			}
			want[c] = id
		}
	}
	if len(want) != n {
		t.Fatalf("%d label sets allocated, want %d", len(want), n)
	}
	t.Logf("%d global identities in use (%d, %d, %d held per node): %s", n,
		len(holds[0]), len(holds[1]), len(holds[2]), time.Since(start).Round(time.Millisecond))
	check(t, agents, holds, want, "kvstore, before the roll")

	for _, mode := range path {
		stepStart := time.Now()
		// Each step ends with a SIGKILL of the node that collects in
		// the store the new mode reads: the node that reports
		// convergence at the end of a double-write step is that store's
		// collector, and a killed one must not leave the cluster
		// without one. The others restart first, so the collector, and
		// with it the killed node, changes from step to step.
		last := collectorOf(t, agents, mode)
		for k := range nodes {
			i := (last + 1 + k) % nodes
			a := agents[i]
			sig := syscall.SIGTERM
			if i == last {
				sig = syscall.SIGKILL
			}
			from := a.mode
			restart := time.Now()
			a.stop(sig)
			a.start(mode)
			up := time.Since(restart)
			again, err := a.allocateAll(holds[i])
			if err != nil {
				t.Fatal(err)
			}
			var renumbered []string
			for c, id := range again {
				if id != want[c] {
					renumbered = append(renumbered, fmt.Sprintf("%s: %d, was %d", c, id, want[c]))
				}
			}
			if len(renumbered) > 0 {
				slices.Sort(renumbered)
				t.Fatalf("%s, %s -> %s after %s: %d of its %d label sets renumbered: %s", a.name, from, mode, sig,
					len(renumbered), len(holds[i]), strings.Join(renumbered[:min(5, len(renumbered))], "; "))
			}
			what := fmt.Sprintf("%s: %s %s -> %s by %s", mode, a.name, from, mode, sig)
			check(t, agents, holds, want, what)
			t.Logf("%s: up in %s, its %d label sets again and the checks in %s", what,
				up.Round(time.Millisecond), len(holds[i]), (time.Since(restart) - up).Round(time.Millisecond))
		}
		if strings.HasPrefix(mode, "doublewrite-") {
			waitConverged(t, agents, n, mode)
		}
		t.Logf("step to %s: %s", mode, time.Since(stepStart).Round(time.Millisecond))
	}
	t.Logf("whole test: %s", time.Since(begin).Round(time.Millisecond))
}

// collectorOf returns the index of the node that collects in the store
// mode reads, by its gauge.
func collectorOf(t *testing.T, agents []*agent, mode string) int {
	t.Helper()
	gauge := "identityd_identity_gc_leader"
	if mode == "crd" || mode == "doublewrite-readcrd" {
		gauge = "identityd_crd_identity_gc_leader"
	}
	var found []int
	for i, a := range agents {
		code, body := a.get("/metrics")
		if code != 200 {
			t.Fatalf("%s: /metrics: %d %s", a.name, code, body)
		}
		if gauges(body, gauge)[gauge] == 1 {
			found = append(found, i)
		}
	}
	if len(found) != 1 {
		t.Fatalf("before the step to %s: %d nodes have %s 1, want one", mode, len(found), gauge)
	}
	return found[0]
}

// check fails the test unless every node answers every label set of want
// with its ID there, and holds exactly its own label sets.
func check(t *testing.T, agents []*agent, holds [][]labels.Labels, want map[string]identity.NumericIdentity, what string) {
	t.Helper()
	views := make([]view, len(agents))
	errs := make([]error, len(agents))
	var wg sync.WaitGroup
	for i, a := range agents {
		wg.Go(func() { views[i], errs[i] = a.list() })
	}
	wg.Wait()
	var problems []string
	for i, a := range agents {
		if errs[i] != nil {
			t.Fatalf("%s: %v", what, errs[i])
		}
		v := views[i]
		var renumbered, missing []string
		for c, id := range want {
			switch got, ok := v.ids[c]; {
			case !ok:
				missing = append(missing, c)
			case got != id:
				renumbered = append(renumbered, fmt.Sprintf("%s: %d, was %d", c, got, id))
			}
		}
		if len(renumbered)+len(missing)+len(v.twice) > 0 {
			slices.Sort(renumbered)
			slices.Sort(missing)
			problems = append(problems, fmt.Sprintf("%s (%s): %d renumbered %v, %d unknown %v, %d with two IDs %v", a.name, a.mode,
				len(renumbered), renumbered[:min(5, len(renumbered))], len(missing), missing[:min(5, len(missing))],
				len(v.twice), v.twice[:min(5, len(v.twice))]))
		}
		var notHeld, extra []string
		mine := map[string]bool{}
		for _, lbls := range holds[i] {
			c := lbls.Canonical()
			mine[c] = true
			if !v.held[c] {
				notHeld = append(notHeld, c)
			}
		}
		for c := range v.held {
			if !mine[c] {
				extra = append(extra, c)
			}
		}
		if len(notHeld)+len(extra) > 0 {
			problems = append(problems, fmt.Sprintf("%s (%s): %d of its label sets not held %v, %d held that are not its own %v", a.name, a.mode,
				len(notHeld), notHeld[:min(5, len(notHeld))], len(extra), extra[:min(5, len(extra))]))
		}
	}
	// Disagreements: label sets two nodes answer with different IDs.
	disagree := 0
	for c := range want {
		ids := map[identity.NumericIdentity]bool{}
		for _, v := range views {
			if id, ok := v.ids[c]; ok {
				ids[id] = true
			}
		}
		if len(ids) > 1 {
			disagree++
		}
	}
	if disagree > 0 {
		problems = append(problems, fmt.Sprintf("%d label sets with different IDs on different nodes", disagree))
	}
	if len(problems) > 0 {
		t.Fatalf("%s:\n  %s", what, strings.Join(problems, "\n  "))
	}
}

// Convergence gauges, as the reporting node publishes them.
const (
	gaugeCRD      = "identityd_doublewrite_crd_identities"
	gaugeKVStore  = "identityd_doublewrite_kvstore_identities"
	gaugeCRDOnly  = "identityd_doublewrite_crd_only_identities"
	gaugeKVOnly   = "identityd_doublewrite_kvstore_only_identities"
	gaugeDiffer   = "identityd_doublewrite_labels_differ_identities"
	convergeGauge = gaugeKVStore
)

// waitConverged waits until the node that reports convergence (the one
// that collects in the read store) publishes no difference between the
// stores, both holding the n identities, and doublewrite/diff lists no
// difference on any node.
func waitConverged(t *testing.T, agents []*agent, n int, mode string) {
	t.Helper()
	start := time.Now()
	deadline := start.Add(convergeWithin)
	var last string
	for {
		reporter, err := converged(agents, n)
		if err == nil {
			t.Logf("%s: converged (reported by %s, doublewrite/diff empty on every node) %s after the last restart",
				mode, reporter, time.Since(start).Round(time.Millisecond))
			return
		}
		last = err.Error()
		if time.Now().After(deadline) {
			t.Fatalf("%s: the stores did not converge within %s: %s", mode, convergeWithin, last)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// converged returns the reporting node if the stores have converged, else
// an error saying what differs.
func converged(agents []*agent, n int) (string, error) {
	reporter := ""
	for _, a := range agents {
		code, body := a.get("/metrics")
		if code != 200 {
			return "", fmt.Errorf("%s: /metrics: %d %s", a.name, code, body)
		}
		g := gauges(body, gaugeCRD, gaugeKVStore, gaugeCRDOnly, gaugeKVOnly, gaugeDiffer)
		if _, ok := g[convergeGauge]; !ok {
			continue
		}
		if reporter != "" {
			return "", fmt.Errorf("both %s and %s report convergence", reporter, a.name)
		}
		reporter = a.name
		if g[gaugeCRDOnly] != 0 || g[gaugeKVOnly] != 0 || g[gaugeDiffer] != 0 || g[gaugeCRD] != float64(n) || g[gaugeKVStore] != float64(n) {
			return "", fmt.Errorf("%s reports %v", a.name, g)
		}
	}
	if reporter == "" {
		return "", fmt.Errorf("no node reports convergence")
	}
	for _, a := range agents {
		out, err := a.run("doublewrite/diff", "-o", "json")
		if err != nil {
			return "", fmt.Errorf("%s: doublewrite/diff: %v %s", a.name, err, out)
		}
		if s := strings.TrimSpace(out); s != "[]" && s != "null" {
			diffs, err := robustness.DecodeList[map[string]any](s)
			if err != nil || len(diffs) > 0 {
				return "", fmt.Errorf("%s: doublewrite/diff: %d differences (%v): %.300s", a.name, len(diffs), err, s)
			}
		}
	}
	return reporter, nil
}

// gauges returns the values of the unlabelled series names in a /metrics
// body.
func gauges(body string, names ...string) map[string]float64 {
	out := map[string]float64{}
	for line := range strings.Lines(body) {
		name, value, ok := strings.Cut(strings.TrimSpace(line), " ")
		if !ok || !slices.Contains(names, name) {
			continue
		}
		if v, err := strconv.ParseFloat(value, 64); err == nil {
			out[name] = v
		}
	}
	return out
}
