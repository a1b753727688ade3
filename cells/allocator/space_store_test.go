package allocator_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	clientv3 "go.etcd.io/etcd/client/v3"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/eventually"
	"github.com/identityd/identityd/internal/k8stest"
	"github.com/identityd/identityd/internal/metricstest"
	"github.com/identityd/identityd/internal/testhive"
	"github.com/identityd/identityd/internal/testproc"
	"github.com/identityd/identityd/labels"
)

// warnings keeps the warnings about the global identity space that the
// hive logs, and passes every record on to the test's log.
type warnings struct {
	slog.Handler
	mu   *sync.Mutex
	msgs *[]string
}

func (w warnings) Handle(ctx context.Context, r slog.Record) error {
	if r.Level >= slog.LevelWarn && strings.Contains(r.Message, "Global identity space") {
		w.mu.Lock()
		*w.msgs = append(*w.msgs, r.Message)
		w.mu.Unlock()
	}
	return w.Handler.Handle(ctx, r)
}

func (w warnings) WithAttrs(as []slog.Attr) slog.Handler {
	return warnings{w.Handler.WithAttrs(as), w.mu, w.msgs}
}

func (w warnings) WithGroup(name string) slog.Handler {
	return warnings{w.Handler.WithGroup(name), w.mu, w.msgs}
}

// TestSpaceExhaustedEtcd: the etcd store's range filled to 90%, then to
// the last ID (master keys written as other nodes write them), then
// partly freed: the identity-space health scope is degraded with the fill
// from 90% and at exhaustion, with one warning in the log at each change
// of state (up, and down from exhausted to nearly full); a new label set is refused in under 10 ms and the refusal
// counter moves; the health is OK again once the fill is below 90%.
// Without the allocator's watch of the range, health stays OK, nothing is
// logged and no counter moves (checked).
func TestSpaceExhaustedEtcd(t *testing.T) {
	var (
		alloc  allocator.Allocator
		prov   *health.Provider
		server *metrics.Server
		kv     *kvstore.Client
	)
	h := hive.New(
		health.Cell, metrics.Cell, job.Cell, statedb.Cell, statedir.Cell,
		kvstore.Cell, allocator.Cell, etcdstore.Cell,
		cell.Invoke(func(a allocator.Allocator, p *health.Provider, s *metrics.Server, c *kvstore.Client) {
			alloc, prov, server, kv = a, p, s, c
		}),
	)
	dir := t.TempDir()
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(h, func(c *metrics.Config) { c.PrometheusServeAddr = "127.0.0.1:0" })
	hive.AddConfigOverride(h, func(c *globalstore.Config) { c.IdentityGCInterval = 0 })
	var (
		mu   sync.Mutex
		msgs []string
	)
	log := slog.New(warnings{hivetest.Logger(t, hivetest.LogLevel(slog.LevelInfo)).Handler(), &mu, &msgs})
	if _, err := testhive.TryStart(t, h, log); err != nil {
		t.Fatal(err)
	}
	cli := kv.Client()
	cluster := identity.ClusterInfo{Name: "default"}
	lo, hi := cluster.MinID(), cluster.MaxID()
	size := int(hi-lo) + 1
	const prefix = "cilium/state/identities/v1/id/"
	// write puts (or deletes) the master keys of IDs from..to.
	write := func(from, to identity.NumericIdentity, put bool) {
		t.Helper()
		var ops []clientv3.Op
		flush := func() {
			if _, err := cli.Txn(t.Context()).Then(ops...).Commit(); err != nil {
				t.Fatal(err)
			}
			ops = ops[:0]
		}
		for id := from; id <= to; id++ {
			k := prefix + id.String()
			if put {
				ops = append(ops, clientv3.OpPut(k, fmt.Sprintf("k8s:app=fill-%d;", id)))
			} else {
				ops = append(ops, clientv3.OpDelete(k))
			}
			if len(ops) == 100 {
				flush()
			}
		}
		if len(ops) > 0 {
			flush()
		}
	}
	space := func() health.Status {
		for _, s := range prov.All() {
			if strings.HasSuffix(s.Name, "identity-space") {
				return s
			}
		}
		t.Fatal("no identity-space health scope")
		return health.Status{}
	}
	warned := func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), msgs...)
	}
	waitSpace := func(what string, level cell.Level, text string) {
		t.Helper()
		eventually.True(t, what, func() bool {
			s := space()
			return s.Level == level && strings.Contains(s.Message, text)
		})
	}

	if s := space(); s.Level != cell.StatusOK {
		t.Fatalf("identity-space %s %q in an empty range", s.Level, s.Message)
	}
	nearly := lo + identity.NumericIdentity(size*9/10)
	write(lo, nearly-2, true)
	time.Sleep(time.Second)
	if s := space(); s.Level != cell.StatusOK || len(warned()) != 0 {
		t.Fatalf("just below 90%%: identity-space %s %q, warnings %q", s.Level, s.Message, warned())
	}
	write(nearly-1, nearly+100, true)
	// Degraded in its message, still OK (ready): every node can serve.
	waitSpace("identity-space degraded at 90%", cell.StatusOK, "Degraded, serving: Global identity space 90.")
	if w := warned(); len(w) != 1 || !strings.Contains(w[0], "nearly full") {
		t.Fatalf("warnings at 90%%: %q, want one", w)
	}
	write(nearly+101, hi, true)
	waitSpace("identity-space exhausted", cell.StatusOK, "Degraded, serving: Global identity space exhausted")
	if w := warned(); len(w) != 2 || !strings.Contains(w[1], "exhausted") {
		t.Fatalf("warnings at exhaustion: %q, want one more", w)
	}
	for i := range 5 {
		start := time.Now()
		_, _, err := alloc.Allocate(t.Context(), labels.MustParse(fmt.Sprintf("k8s:app=refused-%d", i)))
		if d := time.Since(start); !errors.Is(err, globalstore.ErrSpaceExhausted) || d > 10*time.Millisecond {
			t.Fatalf("allocation in the full range: %v after %s, want ErrSpaceExhausted within 10ms", err, d)
		}
	}
	if w := warned(); len(w) != 2 {
		t.Fatalf("warnings after refusals: %q, want no more", w)
	}
	metricstest.Expect(t, metricstest.Scrape(t, server.Addr()), map[string]float64{
		`identityd_identity_space_exhausted_total`:             5,
		`identityd_identity_space_exhaustion_forecast_seconds`: 0,
	})
	// Freed below 90%: OK again.
	write(nearly-500, hi, false)
	eventually.True(t, "identity-space OK below 90%", func() bool {
		s := space()
		return s.Level == cell.StatusOK && strings.HasPrefix(s.Message, "Global identity space") && strings.Contains(s.Message, "full")
	})
	// One warning per change: exhausted to nearly full on the way down.
	if w := warned(); len(w) != 3 || !strings.Contains(w[2], "nearly full") {
		t.Fatalf("warnings after the release: %q, want one more, for the change back to nearly full", w)
	}
	if _, _, err := alloc.Allocate(t.Context(), labels.MustParse("k8s:app=fits")); err != nil {
		t.Fatal(err)
	}
}

// TestSpaceExhaustedCRD is TestSpaceExhaustedEtcd in crd mode: the CRD
// store's range (32,512 IDs with max-connected-clusters 511) filled to
// 90%, then to the last ID (CiliumIdentity objects created through the
// API server as Cilium's agents create them), then partly freed: the
// identity-space health scope is degraded from 90% and at exhaustion,
// with one warning in the log at each change of state; a new label set
// is refused in under 10 ms and the refusal counter moves; the health is
// OK again once the fill is below 90%. Creating the 32,512 objects takes
// over a minute, so it runs only with ALLOCATOR_CRD_EXHAUSTION=1 (make
// test-long). Without the allocator's count of the store's events, health
// stays OK and nothing is logged (checked).
func TestSpaceExhaustedCRD(t *testing.T) {
	if testproc.CountFromEnv(t, "ALLOCATOR_CRD_EXHAUSTION", 0, 0) == 0 {
		t.Skip("ALLOCATOR_CRD_EXHAUSTION=1 runs it (make test-long)")
	}
	srv := k8stest.Start(t)
	k8stest.InstallCRD(t, srv.RESTConfig(), crdstore.CRDs()...)
	var (
		alloc  allocator.Allocator
		prov   *health.Provider
		server *metrics.Server
	)
	h := hive.New(
		health.Cell, metrics.Cell, job.Cell, statedb.Cell, statedir.Cell,
		allocator.Cell, crdstore.Cell,
		cell.Provide(
			func() *rest.Config { return srv.RESTConfig() },
			// kvstore.Cell provides the node name in a full agent.
			func() identity.NodeName { return "node-a" },
		),
		cell.Invoke(func(a allocator.Allocator, p *health.Provider, s *metrics.Server) {
			alloc, prov, server = a, p, s
		}),
	)
	dir := t.TempDir()
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(h, func(c *metrics.Config) { c.PrometheusServeAddr = "127.0.0.1:0" })
	hive.AddConfigOverride(h, func(c *globalstore.Config) { c.IdentityGCInterval = 0 })
	hive.AddConfigOverride(h, func(c *allocator.Config) {
		c.IdentityAllocationMode = identity.AllocationModeCRD
		c.MaxConnectedClusters = identity.MaxConnectedClusters511
	})
	var (
		mu   sync.Mutex
		msgs []string
	)
	log := slog.New(warnings{hivetest.Logger(t, hivetest.LogLevel(slog.LevelInfo)).Handler(), &mu, &msgs})
	if _, err := testhive.TryStart(t, h, log); err != nil {
		t.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(srv.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	ids := dyn.Resource(crdstore.CiliumIdentityResource)
	cluster := identity.ClusterInfo{Name: "default", MaxConnectedClusters: identity.MaxConnectedClusters511}
	lo, hi := cluster.MinID(), cluster.MaxID()
	size := int(hi-lo) + 1
	nearly := lo + identity.NumericIdentity(size*9/10)
	// The objects from freed on carry a label, so that one request
	// deletes them all.
	freed := nearly - 500
	// create creates the objects of IDs from..to, 16 at a time.
	create := func(from, to identity.NumericIdentity) {
		t.Helper()
		next := make(chan identity.NumericIdentity)
		errs := make(chan error, 16)
		var wg sync.WaitGroup
		for range 16 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for id := range next {
					obj := &unstructured.Unstructured{Object: map[string]any{
						"apiVersion":      crdstore.CiliumGroup + "/" + crdstore.CiliumVersion,
						"kind":            "CiliumIdentity",
						"metadata":        map[string]any{"name": id.String()},
						"security-labels": map[string]any{"k8s:app": fmt.Sprintf("fill-%d", id)},
					}}
					if id >= freed {
						obj.SetLabels(map[string]string{"fill": "freed"})
					}
					if _, err := ids.Create(t.Context(), obj, metav1.CreateOptions{}); err != nil {
						errs <- fmt.Errorf("creating identity %d: %w", id, err)
						return
					}
				}
			}()
		}
	feed:
		for id := from; id <= to; id++ {
			select {
			case next <- id:
			case err := <-errs:
				t.Error(err)
				break feed
			}
		}
		close(next)
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
		if t.Failed() {
			t.FailNow()
		}
	}
	space := func() health.Status {
		for _, s := range prov.All() {
			if strings.HasSuffix(s.Name, "identity-space") {
				return s
			}
		}
		t.Fatal("no identity-space health scope")
		return health.Status{}
	}
	warned := func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), msgs...)
	}
	waitSpace := func(what string, level cell.Level, text string) {
		t.Helper()
		// The store's watch delivers thousands of objects at a time
		// here: a minute for a loaded machine.
		var last health.Status
		for deadline := time.Now().Add(time.Minute); ; time.Sleep(10 * time.Millisecond) {
			last = space()
			if last.Level == level && strings.Contains(last.Message, text) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s: identity-space %s %q", what, last.Level, last.Message)
			}
		}
	}

	start := time.Now()
	create(lo, nearly-2)
	// The scope's message changes with the level only while it is OK:
	// the allocator has the last object when the check looks.
	eventually.Within(t, time.Minute, "the allocator sees the objects just below 90%", func() bool { return alloc.LookupByID(nearly-2) != nil })
	if s := space(); strings.Contains(s.Message, "Degraded") || len(warned()) != 0 {
		t.Fatalf("just below 90%%: identity-space %s %q, warnings %q", s.Level, s.Message, warned())
	}
	create(nearly-1, nearly+100)
	waitSpace("identity-space degraded at 90%", cell.StatusOK, "Degraded, serving: Global identity space 90.")
	if w := warned(); len(w) != 1 || !strings.Contains(w[0], "nearly full") {
		t.Fatalf("warnings at 90%%: %q, want one", w)
	}
	create(nearly+101, hi)
	t.Logf("%d CiliumIdentity objects created in %s", size, time.Since(start))
	waitSpace("identity-space exhausted", cell.StatusOK, "Degraded, serving: Global identity space exhausted")
	if w := warned(); len(w) != 2 || !strings.Contains(w[1], "exhausted") {
		t.Fatalf("warnings at exhaustion: %q, want one more", w)
	}
	for i := range 5 {
		start := time.Now()
		_, _, err := alloc.Allocate(t.Context(), labels.MustParse(fmt.Sprintf("k8s:app=refused-%d", i)))
		if d := time.Since(start); !errors.Is(err, globalstore.ErrSpaceExhausted) || d > 10*time.Millisecond {
			t.Fatalf("allocation in the full range: %v after %s, want ErrSpaceExhausted within 10ms", err, d)
		}
	}
	if w := warned(); len(w) != 2 {
		t.Fatalf("warnings after refusals: %q, want no more", w)
	}
	metricstest.Expect(t, metricstest.Scrape(t, server.Addr()), map[string]float64{
		`identityd_identity_space_exhausted_total`:             5,
		`identityd_identity_space_exhaustion_forecast_seconds`: 0,
	})
	// Freed below 90%: OK again.
	if err := ids.DeleteCollection(t.Context(), metav1.DeleteOptions{}, metav1.ListOptions{LabelSelector: "fill=freed"}); err != nil {
		t.Fatal(err)
	}
	eventually.True(t, "identity-space OK below 90%", func() bool {
		s := space()
		return s.Level == cell.StatusOK && strings.HasPrefix(s.Message, "Global identity space") && strings.Contains(s.Message, "full")
	})
	// One warning per change: exhausted to nearly full on the way down.
	if w := warned(); len(w) != 3 || !strings.Contains(w[2], "nearly full") {
		t.Fatalf("warnings after the release: %q, want one more, for the change back to nearly full", w)
	}
	if _, _, err := alloc.Allocate(t.Context(), labels.MustParse("k8s:app=fits")); err != nil {
		t.Fatal(err)
	}
}
