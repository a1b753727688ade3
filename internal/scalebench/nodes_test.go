package scalebench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/rest"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// node is one simulated agent: a hive of its own with the allocator, which
// owns the node's references, and the mode's store with its own connection
// to the server.
type node struct {
	index int
	name  string
	h     *hive.Hive
	log   *slog.Logger
	alloc allocator.Allocator
	// gc reads the store's collection counters.
	gc func() gcCounts

	// mu orders the node's changes; own holds its own label sets' identities,
	// oldest first, and next numbers the next one.
	mu     sync.Mutex
	shared []*identity.Identity
	own    []*identity.Identity
	next   int
}

// gcCounts is what the stores' collection metrics have in common, and
// what the CRD store counts besides.
type gcCounts struct {
	runs, failed, deleted, skipped, marked, unmarked uint64
}

// storeMetrics are the collectors a node's cells contribute to the agent's
// /metrics (cells/metrics), read here as a scrape would read them.
type storeMetrics struct {
	cell.In
	Collectors []prometheus.Collector `group:"identityd-metrics"`
}

// gcFromMetrics reads the collection's counters of a node from its
// metrics: <prefix>_entries by status and <prefix>_runs by outcome (a
// run in progress counts as a success).
func gcFromMetrics(collectors []prometheus.Collector, prefix string) (gcCounts, error) {
	reg := prometheus.NewRegistry()
	for _, c := range collectors {
		if err := reg.Register(c); err != nil {
			return gcCounts{}, err
		}
	}
	families, err := reg.Gather()
	if err != nil {
		return gcCounts{}, err
	}
	var out gcCounts
	for _, f := range families {
		for _, m := range f.GetMetric() {
			label := ""
			for _, l := range m.GetLabel() {
				label = l.GetValue()
			}
			v := uint64(m.GetGauge().GetValue())
			switch f.GetName() {
			case prefix + "_entries":
				switch label {
				case "deleted":
					out.deleted = v
				case "skipped":
					out.skipped = v
				case "marked":
					out.marked = v
				case "unmarked":
					out.unmarked = v
				}
			case prefix + "_runs":
				out.runs += v
				if label == "failure" {
					out.failed = v
				}
			}
		}
	}
	return out, nil
}

// readGC is a node's gc: the counters of gcFromMetrics, or zero when the
// metrics cannot be read, which the run's checks then show.
func readGC(log *slog.Logger, collectors *[]prometheus.Collector, prefix string) func() gcCounts {
	return func() gcCounts {
		c, err := gcFromMetrics(*collectors, prefix)
		if err != nil {
			log.Error("Reading the collection's metrics", "error", err)
		}
		return c
	}
}

func (a gcCounts) minus(b gcCounts) gcCounts {
	return gcCounts{a.runs - b.runs, a.failed - b.failed, a.deleted - b.deleted, a.skipped - b.skipped, a.marked - b.marked, a.unmarked - b.unmarked}
}

func nodeName(i int) string { return fmt.Sprintf("scale-node-%03d", i) }

// sharedLabels is the j-th label set every node holds; ownLabels the j-th of
// node i's own. Both look like a pod's: an app, its namespace, its service
// account and the cluster.
func sharedLabels(j int) labels.Labels {
	return labels.MustParse(
		fmt.Sprintf("k8s:app=shared-%d", j),
		"k8s:io.kubernetes.pod.namespace=kube-system",
		"k8s:io.cilium.k8s.policy.serviceaccount=shared",
		"k8s:io.cilium.k8s.policy.cluster=default",
	)
}

func ownLabels(i, j int) labels.Labels {
	return labels.MustParse(
		fmt.Sprintf("k8s:app=workload-%d-%d", i, j),
		fmt.Sprintf("k8s:io.kubernetes.pod.namespace=tenant-%d", i),
		fmt.Sprintf("k8s:io.cilium.k8s.policy.serviceaccount=sa-%d", j%7),
		"k8s:io.cilium.k8s.policy.cluster=default",
	)
}

// startEtcdNode starts node i of etcd mode: the kvstore cell with its own
// client (connection, lease, node name) to endpoints, the allocator and
// the etcd store.
func startEtcdNode(ctx context.Context, log *slog.Logger, endpoints []string, i int, cfg config) (*node, error) {
	n := &node{index: i, name: nodeName(i), log: log}
	var (
		store      *etcdstore.Store
		collectors []prometheus.Collector
	)
	n.h = hive.New(
		job.Cell, statedb.Cell, kvstore.Cell, allocator.Cell, etcdstore.Cell,
		cell.Invoke(func(a allocator.Allocator, s *etcdstore.Store, m storeMetrics) {
			n.alloc, store, collectors = a, s, m.Collectors
		}),
	)
	hive.AddConfigOverride(n.h, func(c *kvstore.Config) {
		c.KVStoreEndpoints = endpoints
		c.NodeName = n.name
		c.KVStoreLeaseTTL = leaseTTL
		c.KVStoreDialTimeout = time.Minute
	})
	hive.AddConfigOverride(n.h, func(c *etcdstore.Config) { c.KVStorePeriodicSync = syncInterval })
	hive.AddConfigOverride(n.h, func(c *globalstore.Config) { c.IdentityGCInterval = cfg.gcInterval })
	if err := n.h.Start(log, ctx); err != nil {
		return nil, fmt.Errorf("starting %s: %w", n.name, err)
	}
	if store == nil {
		n.stop(ctx)
		return nil, fmt.Errorf("%s has no etcd store", n.name)
	}
	n.gc = readGC(log, &collectors, "identityd_identity_gc")
	return n, nil
}

// startCRDNode starts node i of crd mode: the allocator and the CRD store,
// on a client configuration of its own (its own transport and
// connections), named by its node name.
func startCRDNode(ctx context.Context, log *slog.Logger, rc *rest.Config, i int, cfg config) (*node, error) {
	n := &node{index: i, name: nodeName(i), log: log}
	rc = ownTransport(rc)
	var (
		store      *crdstore.Store
		collectors []prometheus.Collector
	)
	n.h = hive.New(
		job.Cell, statedb.Cell, allocator.Cell, crdstore.Cell,
		cell.Provide(
			func() *rest.Config { return rc },
			func() identity.NodeName { return identity.NodeName(n.name) },
		),
		cell.Invoke(func(a allocator.Allocator, s *crdstore.Store, m storeMetrics) {
			n.alloc, store, collectors = a, s, m.Collectors
		}),
	)
	hive.AddConfigOverride(n.h, func(c *allocator.Config) { c.IdentityAllocationMode = identity.AllocationModeCRD })
	// Only identityd nodes allocate: the heartbeat timeout may go below
	// what Cilium agents need.
	hive.AddConfigOverride(n.h, func(c *crdstore.Config) {
		c.IdentityNodeLeaseTTL = leaseTTL
		c.IdentityGCCiliumAgents = false
	})
	hive.AddConfigOverride(n.h, func(c *globalstore.Config) {
		c.IdentityGCInterval = cfg.gcInterval
		c.IdentityHeartbeatTimeout = heartbeat
	})
	if err := n.h.Start(log, ctx); err != nil {
		return nil, fmt.Errorf("starting %s: %w", n.name, err)
	}
	if store == nil {
		n.stop(ctx)
		return nil, fmt.Errorf("%s has no CRD store", n.name)
	}
	n.gc = readGC(log, &collectors, "identityd_crd_identity_gc")
	return n, nil
}

// ownTransport returns a copy of rc that client-go cannot share a transport
// for: a configuration with a proxy function is never cached, so each node
// opens its own connections, as separate agents do. The answers to its
// writes are counted in writeAnswers.
func ownTransport(rc *rest.Config) *rest.Config {
	rc = rest.CopyConfig(rc)
	rc.Proxy = func(*http.Request) (*url.URL, error) { return nil, nil }
	rc.Wrap(func(rt http.RoundTripper) http.RoundTripper { return answerCounter{rt} })
	return rc
}

// writeAnswers counts, by "VERB resource", the bytes of the bodies of the
// API server's answers to the nodes' writes, as the nodes read them: the
// server's own metrics size the answers to reads only.
var writeAnswers sync.Map

// writeAnswerBytes is a snapshot of writeAnswers as series of the name
// writeAnswerSeries, labelled verb and resource.
func writeAnswerBytes() snapshot {
	out := snapshot{}
	writeAnswers.Range(func(k, v any) bool {
		verb, resource, _ := strings.Cut(k.(string), " ")
		series := fmt.Sprintf("%s{resource=%q,verb=%q}", writeAnswerSeries, resource, verb)
		out[series] = sample{name: writeAnswerSeries, labels: map[string]string{"verb": verb, "resource": resource}, value: float64(v.(*atomic.Uint64).Load())}
		return true
	})
	return out
}

const writeAnswerSeries = "scalebench_write_answer_bytes"

type answerCounter struct{ next http.RoundTripper }

func (c answerCounter) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := c.next.RoundTrip(req)
	if err != nil || !writeVerbs[req.Method] {
		return resp, err
	}
	// /apis/<group>/<version>[/namespaces/<namespace>]/<resource>[/<name>[/<subresource>]]
	parts := strings.Split(strings.Trim(req.URL.Path, "/"), "/")
	if len(parts) < 4 || parts[0] != "apis" {
		return resp, err
	}
	if parts[3] == "namespaces" && len(parts) >= 6 {
		parts = slices.Delete(parts, 3, 5)
	}
	key := req.Method + " " + parts[3]
	v, ok := writeAnswers.Load(key)
	if !ok {
		v, _ = writeAnswers.LoadOrStore(key, new(atomic.Uint64))
	}
	resp.Body = countingBody{resp.Body, v.(*atomic.Uint64)}
	return resp, nil
}

type countingBody struct {
	io.ReadCloser
	n *atomic.Uint64
}

func (b countingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.n.Add(uint64(n))
	return n, err
}

func (n *node) stop(ctx context.Context) error {
	return n.h.Stop(n.log, ctx)
}

// allocateInitial takes the node's shared label sets and its own ones.
func (n *node) allocateInitial(ctx context.Context, cfg config) error {
	for j := range cfg.shared {
		id, err := n.allocate(ctx, sharedLabels(j))
		if err != nil {
			return err
		}
		n.shared = append(n.shared, id)
	}
	for range cfg.identities - cfg.shared {
		if err := n.allocateOwn(ctx); err != nil {
			return err
		}
	}
	return nil
}

func (n *node) allocate(ctx context.Context, lbls labels.Labels) (*identity.Identity, error) {
	id, _, err := n.alloc.Allocate(ctx, lbls)
	if err != nil {
		return nil, fmt.Errorf("%s: allocating %s: %w", n.name, lbls, err)
	}
	if id.ID.IsReserved() || id.ID.Scope() != identity.ScopeGlobal {
		return nil, fmt.Errorf("%s: %s got identity %d, not a global one", n.name, lbls, id.ID)
	}
	return id, nil
}

func (n *node) allocateOwn(ctx context.Context) error {
	n.mu.Lock()
	j := n.next
	n.next++
	n.mu.Unlock()
	id, err := n.allocate(ctx, ownLabels(n.index, j))
	if err != nil {
		return err
	}
	n.mu.Lock()
	n.own = append(n.own, id)
	n.mu.Unlock()
	return nil
}

// change releases the node's oldest own label set and allocates a new one:
// one workload going, another coming.
func (n *node) change(ctx context.Context) error {
	n.mu.Lock()
	if len(n.own) == 0 {
		n.mu.Unlock()
		return errors.New(n.name + " holds no label set of its own")
	}
	old := n.own[0]
	n.own = n.own[1:]
	n.mu.Unlock()
	if _, err := n.alloc.Release(ctx, old); err != nil {
		return fmt.Errorf("%s: releasing %d: %w", n.name, old.ID, err)
	}
	return n.allocateOwn(ctx)
}

// forEach runs fn for every node, at most parallel at a time, and returns
// the first error.
func forEach(nodes []*node, parallel int, fn func(*node) error) error {
	var (
		wg    sync.WaitGroup
		sem   = make(chan struct{}, parallel)
		first atomic.Pointer[error]
	)
	for _, n := range nodes {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			if err := fn(n); err != nil {
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
