package robustness

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/k8stest"
	"github.com/identityd/identityd/labels"
)

// defaultDuration is the workload's length in a plain `go test` run: long
// enough for every kind of fault, short enough for `make test` on two
// cores. ROBUSTNESS_DURATION sets another (e.g. 20m).
const defaultDuration = 45 * time.Second

const (
	nodes = 3
	// defaultWorkers is the number of workers per agent unless
	// ROBUSTNESS_WORKERS sets another; more of them make concurrent
	// allocations of global identities share etcd requests.
	defaultWorkers = 2
	globalSets     = 24
	localSets      = 24
	// quiet is the end of the workload without faults, so that the last
	// operations run on a healthy cluster.
	quiet = 5 * time.Second
)

func runDuration(t *testing.T) time.Duration {
	s := os.Getenv("ROBUSTNESS_DURATION")
	if s == "" {
		return defaultDuration
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 20*time.Second {
		t.Fatalf("ROBUSTNESS_DURATION=%q: want a duration of at least 20s", s)
	}
	return d
}

func runWorkers(t *testing.T) int {
	s := os.Getenv("ROBUSTNESS_WORKERS")
	if s == "" {
		return defaultWorkers
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 || n > 64 {
		t.Fatalf("ROBUSTNESS_WORKERS=%q: want 1 to 64 workers per agent", s)
	}
	return n
}

func runSeed(t *testing.T) uint64 {
	if s := os.Getenv("ROBUSTNESS_SEED"); s != "" {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("ROBUSTNESS_SEED=%q: %v", s, err)
		}
		return n
	}
	return uint64(time.Now().UnixNano())
}

// labelSet is one label set of the workload: its shell arguments and its
// canonical form, which names it in the history and in etcd keys.
type labelSet struct {
	args      []string
	canonical string
	global    bool
}

func workloadSets(t *testing.T) []labelSet {
	var sets []labelSet
	add := func(global bool, args ...string) {
		lbls, err := labels.Parse(args...)
		if err != nil {
			t.Fatal(err)
		}
		if identity.ScopeForLabels(lbls).IsLocal() == global {
			t.Fatalf("%v: unexpected scope", args)
		}
		sets = append(sets, labelSet{args: args, canonical: lbls.Canonical(), global: global})
	}
	for i := range globalSets {
		add(true, fmt.Sprintf("k8s:app=app%d", i), "k8s:io.kubernetes.pod.namespace=robustness")
	}
	for i := range localSets {
		add(false, fmt.Sprintf("cidr:10.%d.0.0/16", i), "reserved:world")
	}
	return sets
}

// variant is the global store the agents of a run share: the flags that
// point an agent at it, the faults beside those of etcd and the agents,
// and how its side of the final state is read.
type variant struct {
	agentArgs []string
	faults    []EventKind
	// api is the Kubernetes API server in CRD mode, nil in etcd mode.
	api *k8stest.Server
	// readFinal fills in the store's side of f.
	readFinal func(f *FinalState) error
	// refs counts the references of the final state, for the log.
	refs func(f FinalState) int
	// freshPercent is the share of a worker's allocations that take a
	// label set nobody used before and release it at once: garbage for
	// the collection to delete while the faults go on.
	freshPercent int
}

// TestRobustness runs 3 etcd members and 3 identityd agents as processes,
// drives a random workload through the agents' shells while faults hit
// etcd and the agents, then checks the history and the final state.
func TestRobustness(t *testing.T) {
	runRobustness(t, func(c *etcdtest.Cluster) variant {
		cli := c.Client(t)
		return variant{
			agentArgs: []string{
				"--kvstore-endpoints", strings.Join(c.Endpoints(), ","),
				"--kvstore-lease-ttl", leaseTTL.String(),
				"--kvstore-request-timeout", "2s",
			},
			readFinal: func(f *FinalState) error { return readEtcd(cli, f) },
			refs:      func(f FinalState) int { return countRefs(f.RefKeys) },
		}
	})
}

// TestRobustnessCRD is TestRobustness in CRD mode: a Kubernetes API server
// on the 3-member etcd cluster keeps the global identities, the agents run
// with --identity-allocation-mode=crd, and the API server is restarted and
// killed beside the faults of etcd and the agents.
func TestRobustnessCRD(t *testing.T) {
	if m := os.Getenv("ROBUSTNESS_MODE"); m != "crd" && m != "all" {
		// Its setup (an API server, the CRDs) makes even the short run
		// longer than make test's share allows.
		t.Skip("the CRD variant runs with ROBUSTNESS_MODE=crd or all (make robustness ROBUSTNESS_MODE=crd)")
	}
	runRobustness(t, func(c *etcdtest.Cluster) variant {
		api := k8stest.Start(t, k8stest.WithEtcd(c.Endpoints()...))
		// The kubeconfig embeds the admin's certificate: a client of
		// RESTConfig's certificate files would start a watcher of the
		// files that outlives the test.
		cfg, err := clientcmd.BuildConfigFromFlags("", api.Kubeconfig())
		if err != nil {
			t.Fatal(err)
		}
		dyn, err := dynamic.NewForConfig(cfg)
		if err != nil {
			t.Fatal(err)
		}
		return variant{
			agentArgs: []string{
				"--identity-allocation-mode", "crd",
				"--k8s-kubeconfig-path", api.Kubeconfig(),
				"--identity-node-lease-ttl", leaseTTL.String(),
				// The shortest the store allows where no Cilium
				// agent allocates: identities marked unused are
				// deleted within the run.
				"--identity-heartbeat-timeout", crdstore.MinHeartbeatTimeout.String(),
				"--identity-gc-cilium-agents=false",
			},
			faults: []EventKind{APIServerRestart, APIServerKill},
			// The workload's label sets are always held by someone
			// after the first seconds, and a marked identity is
			// deleted only after the heartbeat timeout: without fresh
			// sets the collection would mark and never delete.
			freshPercent: 5,
			api:          api,
			readFinal:    func(f *FinalState) error { return readCRD(dyn, f) },
			refs: func(f FinalState) int {
				n := 0
				for _, ids := range f.NodeRefs {
					n += len(ids)
				}
				return n
			},
		}
	})
}

// runRobustness runs the agents on the store that setup starts on the etcd
// cluster, with the workload and the faults, and checks the outcome.
func runRobustness(t *testing.T, setup func(*etcdtest.Cluster) variant) {
	if testing.Short() {
		t.Skip("runs etcd and identityd processes with faults for a minute or more")
	}
	dur, seed, workersPerNode := runDuration(t), runSeed(t), runWorkers(t)
	t.Logf("duration %s, %d workers per agent, seed %d (ROBUSTNESS_SEED=%d repeats the choices)", dur, workersPerNode, seed, seed)
	setupStart := time.Now()

	bin := buildAgent(t)
	// A process crash loses no page cache, so fsync buys nothing here.
	c := etcdtest.StartCluster(t, 3, etcdtest.WithUnsafeNoFsync())
	v := setup(c)
	agents := make([]*agent, nodes)
	for i := range agents {
		agents[i] = newAgent(t, bin, fmt.Sprintf("node%d", i+1), v.agentArgs)
		if err := agents[i].start(); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, a := range agents {
			a.kill()
		}
		if t.Failed() {
			for _, a := range agents {
				t.Logf("log of %s:\n%s", a.name, tail(a.logPath, 16<<10))
				// The whole log, every incarnation of the agent, is
				// kept beside the history: the temporary directory
				// goes with the test.
				keep := filepath.Join(os.TempDir(), fmt.Sprintf("identityd-robustness-%d-%s.log", seed, a.name))
				if data, err := os.ReadFile(a.logPath); err == nil && os.WriteFile(keep, data, 0o600) == nil {
					t.Logf("full log of %s written to %s", a.name, keep)
				}
			}
		}
	})
	t.Logf("setup took %s", time.Since(setupStart).Round(time.Millisecond))

	h := NewHistory()
	// Registered after the agents' cleanup, so run before it: the history
	// of a run that ends early is kept too.
	t.Cleanup(func() {
		if t.Failed() {
			writeHistory(t, h, seed)
		}
	})
	sets := workloadSets(t)
	workStart := time.Now()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var wg sync.WaitGroup
	for i, a := range agents {
		for j := range workersPerNode {
			w := &worker{a: a, h: h, sets: sets, rng: rand.New(rand.NewPCG(seed, uint64(i*workersPerNode+j+1))),
				name: fmt.Sprintf("%s-%d", a.name, j), freshPercent: v.freshPercent}
			wg.Go(func() { w.run(ctx) })
		}
	}
	// Faults run on the test's goroutine, so that a failed repair can end
	// the test.
	kinds := append([]EventKind{EtcdKill, EtcdPause, NodeKill, EtcdRestartAll}, v.faults...)
	inj := &injector{t: t, c: c, api: v.api, agents: agents, h: h, sets: sets, rng: rand.New(rand.NewPCG(seed, 0))}
	inj.run(kinds, workStart.Add(dur-quiet))
	end := later(workStart.Add(dur), inj.lastFault.Add(quiet))
	time.Sleep(time.Until(end))
	cancel()
	wg.Wait()
	if t.Failed() {
		return
	}
	stats := h.Stats()
	t.Logf("workload: %s", stats)

	// References of killed agents live until their lease expires, and
	// every leader election gives etcd's leases a full TTL again: wait for
	// that after the last fault.
	final, finalViolations := converge(t, v.readFinal, agents, h, inj.lastFault.Add(leaseTTL+15*time.Second))

	checker := Checker{Settle: settle, Grace: restoreGrace}
	res := checker.Check(h)
	violations := append(res.Violations, finalViolations...)
	t.Logf("checked: %d holds, %d local label sets across restarts, %d references in the store",
		res.Holds, res.LocalChecks, v.refs(final))
	for _, v := range violations {
		t.Errorf("%s", v.Format(h.Begin))
	}
	for _, kind := range kinds {
		if stats.Faults[kind] == 0 {
			t.Errorf("no %s fault was injected", kind)
		}
	}
	if res.LocalChecks == 0 {
		t.Errorf("no local label set was checked across an agent restart")
	}
	if stats.OK < 100 {
		t.Errorf("only %d operations succeeded", stats.OK)
	}
	if v.api != nil {
		runs, marked, deleted, skipped := gcSummary(agents)
		t.Logf("garbage collection (the agents' logs): %d runs that changed something, %d identities marked, %d deleted, %d deletes refused by their precondition",
			runs, marked, deleted, skipped)
	}
	t.Logf("total %s, %d violations", time.Since(setupStart).Round(time.Second), len(violations))
}

func writeHistory(t *testing.T, h *History, seed uint64) {
	path := filepath.Join(os.TempDir(), fmt.Sprintf("identityd-robustness-%d.json", seed))
	if f, err := os.Create(path); err == nil {
		h.WriteJSON(f)
		f.Close()
		t.Logf("history written to %s", path)
	}
}

var gcLogLine = regexp.MustCompile(`Garbage collection of global identities .*marked=(\d+) deleted=(\d+) skipped=(\d+)`)

// gcSummary sums the collections the CRD store logged in every incarnation
// of the agents (it logs each run that marked or deleted something, and
// one that skipped a number it did not skip before), to show that the
// collection ran under the faults.
func gcSummary(agents []*agent) (runs, marked, deleted, skipped int) {
	for _, a := range agents {
		data, err := os.ReadFile(a.logPath)
		if err != nil {
			continue
		}
		for _, m := range gcLogLine.FindAllSubmatch(data, -1) {
			runs++
			n := func(i int) int { v, _ := strconv.Atoi(string(m[i])); return v }
			marked, deleted, skipped = marked+n(1), deleted+n(2), skipped+n(3)
		}
	}
	return runs, marked, deleted, skipped
}

func countRefs(refKeys map[string]map[string]identity.NumericIdentity) int {
	n := 0
	for _, refs := range refKeys {
		n += len(refs)
	}
	return n
}

// converge reads the final state until the agents and the store agree or
// the deadline passes, and returns the last state with its violations.
func converge(t *testing.T, readStore func(*FinalState) error, agents []*agent, h *History, deadline time.Time) (FinalState, []Violation) {
	start := time.Now()
	deadline = later(deadline, start.Add(10*time.Second))
	for {
		f, err := finalState(readStore, agents)
		var vs []Violation
		if err == nil {
			vs = CheckFinal(h, f)
			if len(vs) == 0 {
				t.Logf("agents and the store agree after %s", time.Since(start).Round(time.Millisecond))
				return f, nil
			}
		}
		if time.Now().After(deadline) {
			if err != nil {
				t.Fatalf("reading the final state: %v", err)
			}
			return f, vs
		}
		time.Sleep(time.Second)
	}
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// finalState reads what the live agents hold, then the store's side.
func finalState(readStore func(*FinalState) error, agents []*agent) (FinalState, error) {
	f := FinalState{
		Held:    map[string]map[string]identity.NumericIdentity{},
		Masters: map[identity.NumericIdentity]string{},
	}
	for _, a := range agents {
		if up, _ := a.state(); !up {
			continue
		}
		held, err := a.heldGlobal()
		if err != nil {
			return f, fmt.Errorf("%s: %w", a.name, err)
		}
		f.Held[a.name] = held
	}
	return f, readStore(&f)
}

// readEtcd reads the master and reference keys.
func readEtcd(cli *clientv3.Client, f *FinalState) error {
	f.RefKeys = map[string]map[string]identity.NumericIdentity{}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := cli.Get(ctx, etcdstore.IdentitiesPrefix+"/", clientv3.WithPrefix())
	if err != nil {
		return err
	}
	for _, kv := range resp.Kvs {
		key := string(kv.Key)
		switch {
		case strings.HasPrefix(key, etcdstore.MasterKeyPrefix):
			id, err := identity.ParseNumericIdentity(strings.TrimPrefix(key, etcdstore.MasterKeyPrefix))
			if err != nil {
				return fmt.Errorf("master key %s: %w", key, err)
			}
			f.Masters[id] = string(kv.Value)
		case strings.HasPrefix(key, etcdstore.ReferenceKeyPrefix):
			rest := strings.TrimPrefix(key, etcdstore.ReferenceKeyPrefix)
			i := strings.LastIndexByte(rest, '/')
			if i < 0 {
				return fmt.Errorf("reference key %s has no node", key)
			}
			id, err := identity.ParseNumericIdentity(string(kv.Value))
			if err != nil {
				return fmt.Errorf("reference key %s: %w", key, err)
			}
			lbls, node := rest[:i], rest[i+1:]
			if f.RefKeys[node] == nil {
				f.RefKeys[node] = map[string]identity.NumericIdentity{}
			}
			f.RefKeys[node][lbls] = id
		}
	}
	return nil
}

// readCRD reads the CiliumIdentity objects and the IdentityNode objects
// whose lease has not ended: an expired record protects nothing, so a live
// node's identities count as unlisted, and a killed node's record may stay
// until the collector deletes it.
func readCRD(dyn dynamic.Interface, f *FinalState) error {
	f.NodeRefs = map[string][]identity.NumericIdentity{}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ids, err := dyn.Resource(crdstore.CiliumIdentityResource).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	for _, u := range ids.Items {
		var obj crdstore.CiliumIdentity
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &obj); err != nil {
			return fmt.Errorf("CiliumIdentity %s: %w", u.GetName(), err)
		}
		id, err := identity.ParseNumericIdentity(obj.Name)
		if err != nil {
			return fmt.Errorf("CiliumIdentity %s: %w", obj.Name, err)
		}
		var ls []labels.Label
		for k, v := range obj.SecurityLabels {
			l, err := labels.ParseLabel(k + "=" + v)
			if err != nil {
				return fmt.Errorf("CiliumIdentity %s: %w", obj.Name, err)
			}
			ls = append(ls, l)
		}
		lbls, err := labels.New(ls...)
		if err != nil {
			return fmt.Errorf("CiliumIdentity %s: %w", obj.Name, err)
		}
		f.Masters[id] = lbls.Canonical()
	}
	nodes, err := dyn.Resource(crdstore.IdentityNodeResource).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	now := metav1.Now()
	for _, u := range nodes.Items {
		var obj crdstore.IdentityNode
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &obj); err != nil {
			return fmt.Errorf("IdentityNode %s: %w", u.GetName(), err)
		}
		if obj.Expired(now) {
			continue
		}
		refs := []identity.NumericIdentity{}
		for _, id := range obj.Spec.Identities {
			refs = append(refs, identity.NumericIdentity(id))
		}
		f.NodeRefs[obj.Name] = refs
	}
	return nil
}

// held is a reference a worker took and has not released yet.
type held struct {
	set labelSet
	id  identity.NumericIdentity
}

// worker drives one shell connection to one agent: random allocations and
// releases of its own references.
type worker struct {
	a     *agent
	h     *History
	sets  []labelSet
	rng   *rand.Rand
	sh    *Shell
	gen   int
	holds []held
	// name names the worker's fresh label sets; freshPercent is the share
	// of allocations that take one (variant.freshPercent).
	name         string
	freshPercent int
	fresh        int
}

func (w *worker) run(ctx context.Context) {
	defer func() {
		if w.sh != nil {
			w.sh.Close()
		}
	}()
	for ctx.Err() == nil {
		up, gen := w.a.state()
		if gen != w.gen {
			// A new process: the references of the old one died with it.
			w.holds, w.gen = nil, gen
			w.closeShell()
		}
		if !up {
			time.Sleep(50 * time.Millisecond)
			continue
		}
		if w.sh == nil {
			sh, err := DialShell(w.a.socket(), time.Second)
			if err != nil {
				time.Sleep(50 * time.Millisecond)
				continue
			}
			w.sh = sh
		}
		if len(w.holds) > 0 && w.rng.IntN(100) < 45 {
			i := w.rng.IntN(len(w.holds))
			hd := w.holds[i]
			w.holds = append(w.holds[:i], w.holds[i+1:]...)
			w.release(hd)
		} else if w.freshPercent > 0 && w.rng.IntN(100) < w.freshPercent {
			w.allocateFresh()
		} else {
			w.allocate(w.sets[w.rng.IntN(len(w.sets))])
		}
		// Leave the CPU to the processes under test.
		time.Sleep(time.Duration(5+w.rng.IntN(25)) * time.Millisecond)
	}
}

func (w *worker) closeShell() {
	if w.sh != nil {
		w.sh.Close()
		w.sh = nil
	}
}

func (w *worker) allocate(set labelSet) {
	op, ok := do(w.sh, w.h, w.a.name, OpAllocate, set, 0)
	if !ok {
		w.closeShell()
	}
	if op.Outcome == OK {
		w.holds = append(w.holds, held{set, op.ID})
	}
}

// allocateFresh allocates a global label set no one used before and
// releases it at once.
func (w *worker) allocateFresh() {
	w.fresh++
	args := []string{fmt.Sprintf("k8s:app=fresh-%s-%d", w.name, w.fresh), "k8s:io.kubernetes.pod.namespace=robustness"}
	set := labelSet{args: args, canonical: labels.MustParse(args...).Canonical(), global: true}
	op, ok := do(w.sh, w.h, w.a.name, OpAllocate, set, 0)
	if !ok {
		w.closeShell()
		return
	}
	if op.Outcome == OK {
		w.release(held{set, op.ID})
	}
}

func (w *worker) release(hd held) {
	if _, ok := do(w.sh, w.h, w.a.name, OpRelease, hd.set, hd.id); !ok {
		w.closeShell()
	}
}

// do runs one operation on sh and records it. ok is false when the
// connection must be dropped.
func do(sh *Shell, h *History, node string, kind OpKind, set labelSet, id identity.NumericIdentity) (Op, bool) {
	args := append([]string{"identity/allocate", "-o", "json"}, set.args...)
	if kind == OpRelease {
		args = []string{"identity/release", id.String()}
	}
	op := Op{Node: node, Kind: kind, Labels: set.canonical, Global: set.global, ID: id}
	op.Start = time.Now()
	op.Deadline = op.Start.Add(allocTimeout + opSlack)
	out, err := sh.Run(op.Deadline.Add(observe), args...)
	op.End = time.Now()
	var cmdErr *CommandError
	switch {
	case err == nil:
		op.Outcome = OK
	case errors.As(err, &cmdErr):
		op.Outcome, op.Err = Failed, cmdErr.Msg
	default:
		op.Outcome, op.Err = Unknown, err.Error()
	}
	if op.Outcome == OK && kind == OpAllocate {
		es, perr := parseEntries(out)
		if perr != nil || len(es) != 1 {
			// The agent answered something this client cannot read:
			// record it as unknown rather than guess.
			op.Outcome, op.Err = Unknown, fmt.Sprintf("unreadable answer %q: %v", out, perr)
		} else {
			op.ID = es[0].Identity.ID
		}
	}
	return h.AddOp(op), op.Outcome != Unknown
}
