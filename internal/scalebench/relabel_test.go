package scalebench

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math"
	"net/netip"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	clientv3 "go.etcd.io/etcd/client/v3"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/cells/k8sclient"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/cells/workloads"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/ipcachemap"
	"github.com/identityd/identityd/internal/k8stest"
)

// relabelEnv must be 1 for BenchmarkRelabelStorm to run (make
// bench-relabel): a run of the full size takes hours.
const relabelEnv = "IDENTITYD_BENCH_RELABEL"

// relabelConfig is one relabel storm sweep's settings.
type relabelConfig struct {
	nodes []int
	// modes are the stores of the identities: crd, etcd (the pods are
	// read from the API server in both).
	modes []string
	// management is the nodes' --identity-management-mode: agent, or
	// operator (an identity manager creates the identities, the nodes
	// adopt them).
	management string
	// pods are spread over namespaces namespaces, the first of which
	// (the one relabelled) holds half of them; the pods of a namespace
	// belong to deployments deployments, whose pods share their labels.
	pods, namespaces, deployments int
	// grace is the nodes' --identity-change-grace-period (0: the cell's
	// default, Cilium's 5s).
	grace time.Duration
	// timeout bounds the setup and the storm of one run each.
	timeout time.Duration
}

// loadRelabelConfig reads the RELABEL_* variables over the defaults, the
// full size of the relabel storm: 8 to 64 nodes, 20,000 pods.
func loadRelabelConfig() (relabelConfig, error) {
	c := relabelConfig{nodes: []int{8, 16, 32, 64}, modes: []string{modeCRD}, management: workloads.ManagementModeAgent}
	if v := os.Getenv("RELABEL_MANAGEMENT"); v != "" {
		if v != workloads.ManagementModeAgent && v != workloads.ManagementModeOperator {
			return c, fmt.Errorf("RELABEL_MANAGEMENT=%q: want %s or %s", v, workloads.ManagementModeAgent, workloads.ManagementModeOperator)
		}
		c.management = v
	}
	if v := os.Getenv("RELABEL_MODES"); v != "" {
		c.modes = nil
		for f := range strings.SplitSeq(v, ",") {
			m := strings.TrimSpace(f)
			if m != modeCRD && m != modeEtcd {
				return c, fmt.Errorf("RELABEL_MODES=%q: %q is neither %s nor %s", v, f, modeCRD, modeEtcd)
			}
			c.modes = append(c.modes, m)
		}
	}
	if v := os.Getenv("RELABEL_NODES"); v != "" {
		c.nodes = nil
		for f := range strings.SplitSeq(v, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n < 1 {
				return c, fmt.Errorf("RELABEL_NODES=%q: %q is not a node count", v, f)
			}
			c.nodes = append(c.nodes, n)
		}
	}
	var err error
	if c.pods, err = envInt("RELABEL_PODS", 20000); err != nil {
		return c, err
	}
	if c.namespaces, err = envInt("RELABEL_NAMESPACES", 4); err != nil {
		return c, err
	}
	if c.deployments, err = envInt("RELABEL_DEPLOYMENTS", 50); err != nil {
		return c, err
	}
	if c.grace, err = envDuration("RELABEL_GRACE", 0); err != nil {
		return c, err
	}
	if c.timeout, err = envDuration("RELABEL_TIMEOUT", time.Hour); err != nil {
		return c, err
	}
	if c.namespaces < 2 || c.deployments < 1 || c.pods < 2*c.namespaces || c.timeout <= 0 {
		return c, fmt.Errorf("RELABEL_*: want at least 2 namespaces, 1 deployment, 2 pods per namespace and a timeout, have %+v", c)
	}
	return c, nil
}

// The namespace label whose change is the storm: it is one of every pod's
// identity labels (io.cilium.k8s.namespace.labels.tier).
const (
	stormLabel            = "tier"
	stormBefore           = "gold"
	stormAfter            = "platinum"
	stormLabelAfter       = "k8s:io.cilium.k8s.namespace.labels." + stormLabel + "=" + stormAfter
	stormNamespace        = "storm-0"
	ciliumIdentitiesPath  = "/apis/" + crdstore.CiliumGroup + "/" + crdstore.CiliumVersion + "/ciliumidentities"
	ciliumIdentitiesWatch = "ciliumidentities"
)

// stormPod is one pod of the benchmark.
type stormPod struct {
	ns, name, app, node string
	ip                  netip.Addr
}

// stormPods spreads cfg.pods over the namespaces (half in stormNamespace)
// and n nodes: the k-th pod of a deployment goes to node k mod n, so that
// every deployment with at least n pods runs on every node and its
// identity is shared by all of them.
func stormPods(cfg relabelConfig, n int) []stormPod {
	out := make([]stormPod, 0, cfg.pods)
	big := cfg.pods / 2
	base := netip.MustParseAddr("10.0.0.0").As4()
	start := uint32(base[0])<<24 | uint32(base[1])<<16 | uint32(base[2])<<8 | uint32(base[3])
	for j := range cfg.pods {
		ns, k := stormNamespace, j
		if j >= big {
			r := j - big
			other := cfg.namespaces - 1
			ns, k = fmt.Sprintf("storm-%d", 1+r%other), r/other
		}
		d := k % cfg.deployments
		v := start + uint32(j) + 1
		out = append(out, stormPod{
			ns:   ns,
			name: fmt.Sprintf("pod-%d", j),
			app:  fmt.Sprintf("deploy-%d", d),
			node: nodeName((k / cfg.deployments) % n),
			ip:   netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)}),
		})
	}
	return out
}

// stormNode is one simulated agent of the storm: a hive with the
// allocator, the CRD store, the ipcache and the workloads cell, with its
// own Kubernetes client (a kubeconfig of its own, so client-go gives it
// its own connections) and node name.
type stormNode struct {
	name string
	h    *hive.Hive
	log  *slog.Logger
	w    *workloads.Workloads
}

func startStormNode(ctx context.Context, tb testing.TB, log *slog.Logger, srv *k8stest.Server, etcd []string, i int, cfg relabelConfig) (*stormNode, error) {
	n := &stormNode{name: nodeName(i), log: log}
	// Its own user (a member of system:masters): its own client
	// certificate, hence its own transport in client-go's cache.
	kubeconfig := srv.UserKubeconfig(tb, "system:node:"+n.name, "system:masters")
	dir := tb.TempDir()
	cells := []cell.Cell{
		cell.SimpleHealthCell, job.Cell, statedb.Cell, statedir.Cell, k8sclient.Cell, allocator.Cell, crdstore.Cell, ipcache.Cell, workloads.Cell,
		cell.Invoke(func(w *workloads.Workloads) { n.w = w }),
	}
	mode := identity.AllocationModeCRD
	if etcd != nil {
		// The kvstore client provides the node name.
		mode = identity.AllocationModeKVStore
		cells = append(cells, kvstore.Cell, etcdstore.Cell)
	} else {
		cells = append(cells, cell.Provide(func() identity.NodeName { return identity.NodeName(n.name) }))
	}
	n.h = hive.New(cells...)
	if etcd != nil {
		hive.AddConfigOverride(n.h, func(c *kvstore.Config) {
			c.KVStoreEndpoints = etcd
			c.NodeName = n.name
			c.KVStoreDialTimeout = time.Minute
		})
	}
	hive.AddConfigOverride(n.h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(n.h, func(c *k8sclient.Config) { c.K8sKubeconfigPath = kubeconfig })
	hive.AddConfigOverride(n.h, func(c *allocator.Config) { c.IdentityAllocationMode = mode })
	hive.AddConfigOverride(n.h, func(c *ipcache.Config) { c.IPCacheMap = string(ipcachemap.KindFile) })
	hive.AddConfigOverride(n.h, func(c *workloads.Config) {
		if cfg.grace > 0 {
			c.IdentityChangeGracePeriod = cfg.grace
		}
		c.IdentityManagementMode = cmp.Or(cfg.management, workloads.ManagementModeAgent)
	})
	if err := n.h.Start(log, ctx); err != nil {
		return nil, fmt.Errorf("starting %s: %w", n.name, err)
	}
	if n.w == nil {
		n.h.Stop(log, context.Background())
		return nil, fmt.Errorf("%s has no workloads cell", n.name)
	}
	return n, nil
}

// startStormManager starts the identity manager of operator mode, as
// `identityd manager` composes it, with a client and a record of its own.
func startStormManager(ctx context.Context, tb testing.TB, log *slog.Logger, srv *k8stest.Server, etcd []string, cfg relabelConfig) (*hive.Hive, error) {
	const name = "manager-0"
	kubeconfig := srv.UserKubeconfig(tb, "system:serviceaccount:identityd:identityd-manager", "system:masters")
	dir := tb.TempDir()
	cells := []cell.Cell{
		cell.SimpleHealthCell, job.Cell, statedb.Cell, statedir.Cell, k8sclient.Cell, allocator.Cell, crdstore.Cell, workloads.ManagerCell,
	}
	mode := identity.AllocationModeCRD
	if etcd != nil {
		mode = identity.AllocationModeKVStore
		cells = append(cells, kvstore.Cell, etcdstore.Cell)
	} else {
		cells = append(cells, cell.Provide(func() identity.NodeName { return name }))
	}
	h := hive.New(cells...)
	if etcd != nil {
		hive.AddConfigOverride(h, func(c *kvstore.Config) {
			c.KVStoreEndpoints = etcd
			c.NodeName = name
			c.KVStoreDialTimeout = time.Minute
		})
	}
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(h, func(c *k8sclient.Config) { c.K8sKubeconfigPath = kubeconfig })
	hive.AddConfigOverride(h, func(c *allocator.Config) { c.IdentityAllocationMode = mode })
	hive.AddConfigOverride(h, func(c *workloads.ManagerConfig) { c.IdentityManagerLeaseNamespace = "default" })
	hive.AddConfigOverride(h, func(c *workloads.Config) {
		if cfg.grace > 0 {
			c.IdentityChangeGracePeriod = cfg.grace
		}
		c.IdentityManagementMode = workloads.ManagementModeOperator
	})
	if err := h.Start(log, ctx); err != nil {
		return nil, fmt.Errorf("starting the identity manager: %w", err)
	}
	return h, nil
}

// relabelResult is one run of the storm: n nodes.
type relabelResult struct {
	mode, management        string
	nodes, pods, relabelled int
	setup                   time.Duration
	// converge is the time from the relabel until every pod of the
	// namespace holds the identity of its new labels on its node.
	converge time.Duration
	// window is what the server counted from the relabel until the
	// grace period after the convergence ended (the releases included).
	window     time.Duration
	requests   map[string]float64 // "VERB resource" -> requests
	events     map[string]float64 // resource -> watch events
	identities int                // identities in the store after the storm
	duplicates int                // of them, ones whose labels another one has
	split      int                // label sets nodes hold under different identities
	ciWatches  float64            // CiliumIdentity WATCH requests over the run (crd mode)
	// ciWatchesEnded and ciWatchesOpen are ciWatches' watches that
	// ended, and those still open at the end of the window.
	ciWatchesEnded, ciWatchesOpen float64
	newIDs                        int // identities of the relabelled pods' new label sets
	totalReq                      float64
	totalEvents                   float64
}

// runRelabel runs the storm with n nodes on an API server of its own, the
// identities in the store of mode (in etcd mode, an etcd of its own).
func runRelabel(tb testing.TB, mode string, n int, cfg relabelConfig, out io.Writer) (*relabelResult, error) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	res := &relabelResult{mode: mode, management: cmp.Or(cfg.management, workloads.ManagementModeAgent), nodes: n, pods: cfg.pods, ciWatches: math.NaN()}
	srv := k8stest.Start(tb)
	var es *etcdServer
	if mode == modeEtcd {
		es = startEtcd(tb, n)
	}
	admin := srv.RESTConfig()
	core, err := kubernetes.NewForConfig(admin)
	if err != nil {
		return nil, err
	}
	if err := crdstore.RegisterCRDs(ctx, admin); err != nil {
		return nil, err
	}
	metrics, err := rest.HTTPClientFor(admin)
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(out, "\n== relabel storm, %s mode, management %s, N=%d, %d pods in %d namespaces (%s: %d), %d label sets per namespace: API server at %s\n",
		mode, res.management, n, cfg.pods, cfg.namespaces, stormNamespace, cfg.pods/2, cfg.deployments, srv.URL())
	if es != nil {
		fmt.Fprintf(out, "   %s\n", es.describe())
	}

	setupStart := time.Now()
	setupCtx, setupCancel := context.WithTimeout(ctx, cfg.timeout)
	defer setupCancel()
	for i := range cfg.namespaces {
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("storm-%d", i), Labels: map[string]string{stormLabel: stormBefore}}}
		if _, err := core.CoreV1().Namespaces().Create(setupCtx, ns, metav1.CreateOptions{}); err != nil {
			return nil, fmt.Errorf("creating namespace %s: %w", ns.Name, err)
		}
	}
	pods := stormPods(cfg, n)
	if err := createStormPods(setupCtx, core, pods); err != nil {
		return nil, err
	}
	for _, p := range pods {
		if p.ns == stormNamespace {
			res.relabelled++
		}
	}
	fmt.Fprintf(out, "   %d pods created in %s\n", len(pods), time.Since(setupStart).Round(100*time.Millisecond))

	logs := newCappedLog(os.Stderr, fmt.Sprintf("relabel/%s/%s/N=%d", mode, res.management, n), 20)
	var endpoints []string
	if es != nil {
		endpoints = es.c.Endpoints()
	}
	if res.management == workloads.ManagementModeOperator {
		mlog := logs.logger("manager-0")
		m, err := startStormManager(setupCtx, tb, mlog, srv, endpoints, cfg)
		if err != nil {
			return nil, err
		}
		defer func() {
			sctx, scancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer scancel()
			m.Stop(mlog, sctx)
		}()
	}
	nodes := make([]*stormNode, n)
	idx := make([]int, n)
	for i := range idx {
		idx[i] = i
	}
	err = forEachIndex(idx, 8, func(i int) error {
		nd, err := startStormNode(setupCtx, tb, logs.logger(nodeName(i)), srv, endpoints, i, cfg)
		nodes[i] = nd
		return err
	})
	defer func() {
		logs.mute()
		sctx, scancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer scancel()
		for _, nd := range nodes {
			if nd != nil {
				nd.h.Stop(nd.log, sctx)
			}
		}
	}()
	if err != nil {
		return nil, err
	}
	if err := waitPods(setupCtx, nodes, len(pods), func(workloads.Pod) bool { return true }); err != nil {
		return nil, fmt.Errorf("before the relabel: %w", err)
	}
	res.setup = time.Since(setupStart)
	fmt.Fprintf(out, "   %d nodes hold an identity for every pod, set up in %s\n", n, res.setup.Round(100*time.Millisecond))

	// The storm: the namespace's label changes, and so does every
	// identity label set of its pods.
	// In etcd mode the identities' traffic is etcd's: its series join
	// the API server's under names of their own.
	scrapeAll := func() (snapshot, error) {
		snap, err := scrape(ctx, metrics, srv.URL()+"/metrics")
		if err != nil || es == nil {
			return snap, err
		}
		e, err := es.scrape(ctx)
		if err != nil {
			return nil, err
		}
		for k, v := range e {
			v.name = "etcd " + v.name
			snap["etcd "+k] = v
		}
		return snap, nil
	}
	before, err := scrapeAll()
	if err != nil {
		return nil, err
	}
	stormCtx, stormCancel := context.WithTimeout(ctx, cfg.timeout)
	defer stormCancel()
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:%q}}}`, stormLabel, stormAfter)
	t0 := time.Now()
	if _, err := core.CoreV1().Namespaces().Patch(stormCtx, stormNamespace, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		return nil, fmt.Errorf("relabelling %s: %w", stormNamespace, err)
	}
	onNew := func(p workloads.Pod) bool {
		return !strings.HasPrefix(p.Name, stormNamespace+"/") || slices.Contains(p.Labels.Strings(), stormLabelAfter)
	}
	if err := waitPods(stormCtx, nodes, len(pods), onNew); err != nil {
		return nil, fmt.Errorf("after the relabel: %w", err)
	}
	res.converge = time.Since(t0)
	// The old identities are released after the grace period: the
	// window ends once that has passed.
	grace := cfg.grace
	if grace == 0 {
		grace = workloads.DefaultConfig.IdentityChangeGracePeriod
	}
	sleep(ctx, grace+5*time.Second)
	after, err := scrapeAll()
	if err != nil {
		return nil, err
	}
	res.window = time.Since(t0)
	res.requests, res.events = countStorm(delta(before, after))
	for _, v := range res.requests {
		res.totalReq += v
	}
	for _, v := range res.events {
		res.totalEvents += v
	}
	if es == nil {
		res.ciWatchesEnded, res.ciWatchesOpen = watchRequests(after, ciliumIdentitiesWatch)
		res.ciWatches = res.ciWatchesEnded + res.ciWatchesOpen
	}

	var split map[string][]identity.NumericIdentity
	split, res.newIDs = heldByLabels(nodes)
	res.split = len(split)
	var sets []string
	if es == nil {
		var objs []ciliumIdentity
		if err := k8stest.GetJSON(ctx, admin, ciliumIdentitiesPath, &struct {
			Items *[]ciliumIdentity `json:"items"`
		}{&objs}); err != nil {
			return nil, fmt.Errorf("listing the CiliumIdentity objects: %w", err)
		}
		for _, o := range objs {
			sets = append(sets, o.labelSet())
		}
	} else {
		resp, err := es.cli.Get(ctx, etcdstore.MasterKeyPrefix, clientv3.WithPrefix())
		if err != nil {
			return nil, fmt.Errorf("listing the master keys: %w", err)
		}
		for _, kv := range resp.Kvs {
			sets = append(sets, string(kv.Value))
		}
	}
	res.identities = len(sets)
	res.duplicates = duplicates(sets)
	if logged := logs.count.Load(); logged > 0 {
		fmt.Fprintf(out, "   the nodes logged %d warnings and errors\n", logged)
	}
	printRelabelRun(out, res)
	return res, nil
}

// createStormPods creates the pods, each bound to its node
// (spec.nodeName), and writes their IPs through the status subresource,
// as a kubelet would: 16 at a time.
func createStormPods(ctx context.Context, core kubernetes.Interface, pods []stormPod) error {
	idx := make([]int, len(pods))
	for i := range idx {
		idx[i] = i
	}
	return forEachIndex(idx, 16, func(i int) error {
		p := pods[i]
		pod := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: p.name, Namespace: p.ns,
				// pod-template-hash is no identity label: the pods of a
				// deployment share their identity.
				Labels: map[string]string{"app": p.app, "pod-template-hash": p.name}},
			Spec: corev1.PodSpec{NodeName: p.node, Containers: []corev1.Container{{Name: "c", Image: "registry.invalid/none"}}},
		}
		created, err := core.CoreV1().Pods(p.ns).Create(ctx, pod, metav1.CreateOptions{})
		if err != nil {
			return fmt.Errorf("creating pod %s/%s: %w", p.ns, p.name, err)
		}
		created.Status.Phase = corev1.PodRunning
		created.Status.PodIP = p.ip.String()
		created.Status.PodIPs = []corev1.PodIP{{IP: p.ip.String()}}
		if _, err := core.CoreV1().Pods(p.ns).UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("status of pod %s/%s: %w", p.ns, p.name, err)
		}
		return nil
	})
}

// waitPods waits until the nodes together hold want pods, each ready (on
// the identity of its current labels) and done by the caller's measure.
func waitPods(ctx context.Context, nodes []*stormNode, want int, done func(workloads.Pod) bool) error {
	t := time.NewTicker(200 * time.Millisecond)
	defer t.Stop()
	for {
		ready := 0
		for _, nd := range nodes {
			for _, p := range nd.w.List() {
				if p.State == "ready" && p.Identity != 0 && len(p.IPs) > 0 && done(p) {
					ready++
				}
			}
		}
		if ready == want {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%d of %d pods on their identity: %w", ready, want, ctx.Err())
		case <-t.C:
		}
	}
}

// heldByLabels returns the label sets the nodes hold under more than one
// identity (there must be none: a label set has one identity), and the
// number of identities of the relabelled pods' label sets.
func heldByLabels(nodes []*stormNode) (split map[string][]identity.NumericIdentity, relabelled int) {
	byLabels := map[string][]identity.NumericIdentity{}
	for _, nd := range nodes {
		for _, p := range nd.w.List() {
			key := strings.Join(p.Labels.Strings(), ",")
			if !slices.Contains(byLabels[key], p.Identity) {
				byLabels[key] = append(byLabels[key], p.Identity)
			}
		}
	}
	split = map[string][]identity.NumericIdentity{}
	for key, ids := range byLabels {
		if len(ids) > 1 {
			split[key] = ids
		}
		if strings.Contains(key, stormLabelAfter) {
			relabelled += len(ids)
		}
	}
	return split, relabelled
}

// ciliumIdentity is what the duplicate count reads of a CiliumIdentity.
type ciliumIdentity struct {
	Metadata struct {
		Name string `json:"name"`
	} `json:"metadata"`
	SecurityLabels map[string]string `json:"security-labels"`
}

// labelSet is the object's labels in one canonical string.
func (o ciliumIdentity) labelSet() string {
	keys := make([]string, 0, len(o.SecurityLabels))
	for k, v := range o.SecurityLabels {
		keys = append(keys, k+"="+v)
	}
	sort.Strings(keys)
	return strings.Join(keys, ",")
}

// duplicates counts the identities beyond the first of each label set
// (each given as one canonical string): a label set given two identities
// is what Cilium's design document counted 4,999 of after one relabel at
// 5,000 nodes.
func duplicates(sets []string) int {
	seen := map[string]int{}
	for _, s := range sets {
		seen[s]++
	}
	d := 0
	for _, c := range seen {
		d += c - 1
	}
	return d
}

// countStorm sums a window's requests by "VERB resource[/subresource]"
// and its watch events by resource, from the API server's counters.
func countStorm(d snapshot) (requests, events map[string]float64) {
	requests, events = map[string]float64{}, map[string]float64{}
	for _, x := range d {
		if x.value == 0 {
			continue
		}
		res := x.labels["resource"]
		if s := x.labels["subresource"]; s != "" {
			res += "/" + s
		}
		switch x.name {
		case "etcd grpc_server_msg_received_total":
			requests["etcd "+x.labels["grpc_method"]] += x.value
		case "etcd etcd_debugging_mvcc_events_total":
			events["etcd (identity keys)"] += x.value
		case "apiserver_request_total":
			if res == "" {
				// Non-resource paths: the benchmark's own scrapes of
				// /metrics, health checks.
				res = "(" + x.labels["component"] + " non-resource)"
			}
			requests[x.labels["verb"]+" "+res] += x.value
		case "apiserver_watch_events_total":
			events[res] += x.value
		}
	}
	return requests, events
}

// watchRequests is the number of WATCH requests of resource the server
// saw: the API server counts a watch in apiserver_request_total only when
// it ends, and the ones still open in apiserver_longrunning_requests.
func watchRequests(s snapshot, resource string) (ended, open float64) {
	match := func(l map[string]string) bool {
		return l["verb"] == "WATCH" && l["resource"] == resource && l["subresource"] == ""
	}
	return s.sum("apiserver_request_total", match), s.sum("apiserver_longrunning_requests", match)
}

func printRelabelRun(out io.Writer, r *relabelResult) {
	fmt.Fprintf(out, "   relabel of %s (%d pods): every pod on its new identity after %s; window %s (grace period and 5s after)\n",
		stormNamespace, r.relabelled, r.converge.Round(10*time.Millisecond), r.window.Round(100*time.Millisecond))
	fmt.Fprintf(out, "   identities in the store %d, duplicates %d; label sets held under two identities %d; identities of the new label sets %d\n",
		r.identities, r.duplicates, r.split, r.newIDs)
	if !math.IsNaN(r.ciWatches) {
		fmt.Fprintf(out, "   CiliumIdentity WATCH requests over the run: %.0f, %.0f ended and %.0f open (bound nodes+20 = %d)\n",
			r.ciWatches, r.ciWatchesEnded, r.ciWatchesOpen, r.nodes+20)
	}
	fmt.Fprintf(out, "   %-48s %10s %10s\n", "in the window, at the server", "total", "per node")
	for _, k := range slices.Sorted(maps.Keys(r.requests)) {
		fmt.Fprintf(out, "   %-48s %10.0f %10.1f\n", k, r.requests[k], r.requests[k]/float64(r.nodes))
	}
	for _, k := range slices.Sorted(maps.Keys(r.events)) {
		fmt.Fprintf(out, "   %-48s %10.0f %10.1f\n", "watch events "+k, r.events[k], r.events[k]/float64(r.nodes))
	}
	fmt.Fprintf(out, "   %-48s %10.0f %10.1f\n", "all requests", r.totalReq, r.totalReq/float64(r.nodes))
	fmt.Fprintf(out, "   %-48s %10.0f %10.1f\n", "all watch events", r.totalEvents, r.totalEvents/float64(r.nodes))
}

// printRelabelSummary prints the runs by N and the fitted exponents of
// the window's totals over N (1: flat per node).
func printRelabelSummary(out io.Writer, rs []*relabelResult) {
	if len(rs) == 0 {
		return
	}
	fmt.Fprintf(out, "\n== relabel storm, %s mode, management %s, by N\n", rs[0].mode, rs[0].management)
	fmt.Fprintf(out, "   %5s %7s %10s %6s %9s %9s %11s %11s %8s\n", "N", "pods", "converge", "dups", "CI watch", "N+20", "req/node", "events/node", "setup")
	var x, req, ev []float64
	for _, r := range rs {
		watches := "-"
		if !math.IsNaN(r.ciWatches) {
			watches = fmt.Sprintf("%.0f", r.ciWatches)
		}
		fmt.Fprintf(out, "   %5d %7d %10s %6d %9s %9d %11.1f %11.1f %8s\n", r.nodes, r.pods, r.converge.Round(10*time.Millisecond),
			r.duplicates, watches, r.nodes+20, r.totalReq/float64(r.nodes), r.totalEvents/float64(r.nodes), r.setup.Round(time.Second))
		x = append(x, float64(r.nodes))
		req = append(req, r.totalReq)
		ev = append(ev, r.totalEvents)
	}
	er, ee := exponent(x, req), exponent(x, ev)
	fmt.Fprintf(out, "   exponent of the totals over N (1.1 at most wanted): requests %s, watch events %s\n", fmtExp(er), fmtExp(ee))
}

// forEachIndex runs fn for every index, at most parallel at a time, and
// returns the first error.
func forEachIndex(idx []int, parallel int, fn func(int) error) error {
	var (
		wg    sync.WaitGroup
		sem   = make(chan struct{}, parallel)
		first atomic.Pointer[error]
	)
	for _, i := range idx {
		if first.Load() != nil {
			break
		}
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			if err := fn(i); err != nil {
				first.CompareAndSwap(nil, &err)
			}
		})
	}
	wg.Wait()
	if p := first.Load(); p != nil {
		return *p
	}
	return nil
}

// BenchmarkRelabelStorm runs the relabel storm of the RELABEL_* variables
// (see the package documentation) once for each node count, whatever b.N
// is: run it with -benchtime 1x and IDENTITYD_BENCH_RELABEL=1 (make
// bench-relabel).
func BenchmarkRelabelStorm(b *testing.B) {
	if os.Getenv(relabelEnv) != "1" {
		b.Skip("the relabel storm runs with " + relabelEnv + "=1 (make bench-relabel)")
	}
	cfg, err := loadRelabelConfig()
	if err != nil {
		b.Fatal(err)
	}
	out := io.Writer(os.Stdout)
	fmt.Fprintf(out, "relabel storm: modes %v, management %s, nodes %v, %d pods, %d namespaces, %d label sets per namespace\n",
		cfg.modes, cfg.management, cfg.nodes, cfg.pods, cfg.namespaces, cfg.deployments)
	results := map[string][]*relabelResult{}
	for _, mode := range cfg.modes {
		for _, n := range cfg.nodes {
			b.Run(fmt.Sprintf("%s/%s/N=%d", mode, cfg.management, n), func(b *testing.B) {
				for range b.N {
					r, err := runRelabel(b, mode, n, cfg, out)
					if err != nil {
						b.Fatalf("%s mode, %d nodes: %v", mode, n, err)
					}
					results[mode] = append(results[mode], r)
					checkRelabel(b, r)
					b.ReportMetric(r.converge.Seconds(), "converge-s")
					b.ReportMetric(r.totalReq/float64(n), "req/node")
					b.ReportMetric(r.totalEvents/float64(n), "events/node")
					if !math.IsNaN(r.ciWatches) {
						b.ReportMetric(r.ciWatches, "ci-watches")
					}
				}
			})
		}
	}
	for _, mode := range cfg.modes {
		printRelabelSummary(out, results[mode])
	}
}

// checkRelabel fails tb on what a storm must never do: duplicate
// identities, a label set under two identities, more CiliumIdentity
// watches than Cilium's scale tests allow.
func checkRelabel(tb testing.TB, r *relabelResult) {
	tb.Helper()
	if r.duplicates > 0 {
		tb.Errorf("N=%d: %d duplicate CiliumIdentity objects", r.nodes, r.duplicates)
	}
	if r.split > 0 {
		tb.Errorf("N=%d: %d label sets held under more than one identity", r.nodes, r.split)
	}
	if r.ciWatches > float64(r.nodes+20) {
		tb.Errorf("N=%d: %.0f CiliumIdentity WATCH requests, more than nodes+20", r.nodes, r.ciWatches)
	}
	if math.IsNaN(r.totalReq) {
		tb.Errorf("N=%d: no requests counted", r.nodes)
	}
}

// TestRelabelStormSmoke runs the storm in both stores with the nodes
// creating the identities, and in crd mode with an identity manager
// creating them (operator mode), with two nodes and a few pods: every pod of the relabelled namespace gets the identity of its
// new labels, no identity is duplicated, and the window's counters show
// what the storm must cost: the new identities' creates, their watch
// events on every node, the namespace's patch.
func TestRelabelStormSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("starts an API server and etcd")
	}
	var out strings.Builder
	for _, run := range []struct{ mode, management string }{
		{modeCRD, workloads.ManagementModeAgent}, {modeEtcd, workloads.ManagementModeAgent},
		{modeCRD, workloads.ManagementModeOperator},
	} {
		mode, name := run.mode, run.mode+"/"+run.management
		cfg := relabelConfig{nodes: []int{2}, pods: 24, namespaces: 2, deployments: 3, grace: time.Second, timeout: 3 * time.Minute, management: run.management}
		r, err := runRelabel(t, mode, 2, cfg, &out)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		checkRelabel(t, r)
		if r.relabelled != cfg.pods/2 || r.converge <= 0 || r.window < r.converge {
			t.Errorf("%s: relabelled %d pods (want %d), converged after %s, window %s", name, r.relabelled, cfg.pods/2, r.converge, r.window)
		}
		if r.newIDs != cfg.deployments {
			t.Errorf("%s: %d identities of the new label sets, want %d (one per deployment)", name, r.newIDs, cfg.deployments)
		}
		// A new identity is one create (a POST, a transaction) at least,
		// and one watch event on each node.
		creates, events := r.requests["POST ciliumidentities"], r.events["ciliumidentities"]
		if mode == modeEtcd {
			creates, events = r.requests["etcd Txn"], r.events["etcd (identity keys)"]
			if !math.IsNaN(r.ciWatches) {
				t.Errorf("etcd: %v CiliumIdentity watches counted, want none (not counted)", r.ciWatches)
			}
		} else if r.ciWatches < 2 {
			t.Errorf("crd: %v CiliumIdentity WATCH requests counted, want at least one per node", r.ciWatches)
		}
		if creates < float64(cfg.deployments) {
			t.Errorf("%s: %v creates in the window, want at least %d", name, creates, cfg.deployments)
		}
		if events < float64(cfg.deployments*2) {
			t.Errorf("%s: %v identity watch events in the window, want at least %d (each new identity on each node)", name, events, cfg.deployments*2)
		}
		if got := r.requests["PATCH namespaces"]; got != 1 {
			t.Errorf("%s: %v namespace patches in the window, want the relabel's 1", name, got)
		}
		printRelabelSummary(&out, []*relabelResult{r})
	}
	if t.Failed() || testing.Verbose() {
		t.Log("\n" + out.String())
	}
}
