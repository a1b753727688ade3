package metrics_test

import (
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"

	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/internal/testhive"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		addr string
		err  string
	}{
		{"127.0.0.1:9981", ""},
		{":9981", ""},
		{"[::1]:0", ""},
		{"", ""},
		{"127.0.0.1", "want host:port"},
		{"localhost:http", `port "http" is not a number`},
		{"127.0.0.1:70000", `port "70000" is not a number in 0..65535`},
	} {
		err := metrics.Config{PrometheusServeAddr: tc.addr}.Validate()
		switch {
		case tc.err == "" && err != nil:
			t.Errorf("%q: unexpected error %v", tc.addr, err)
		case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
			t.Errorf("%q: error %v, want one containing %q", tc.addr, err, tc.err)
		}
	}
}

type testHive struct {
	h      *hive.Hive
	server *metrics.Server
	health cell.Health
	reg    *prometheus.Registry
}

func newHive(t *testing.T, addr string, extra ...cell.Cell) *testHive {
	t.Helper()
	th := &testHive{}
	th.h = hive.New(append([]cell.Cell{
		health.Cell, metrics.Cell,
		cell.Invoke(func(s *metrics.Server, h cell.Health, r *prometheus.Registry) { th.server, th.health, th.reg = s, h, r }),
	}, extra...)...)
	hive.AddConfigOverride(th.h, func(c *metrics.Config) { c.PrometheusServeAddr = addr })
	return th
}

func (th *testHive) start(t *testing.T) error {
	t.Helper()
	_, err := testhive.TryStart(t, th.h, nil)
	return err
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

func TestHealthz(t *testing.T) {
	th := newHive(t, "127.0.0.1:0")
	if err := th.start(t); err != nil {
		t.Fatal(err)
	}
	url := "http://" + th.server.Addr() + metrics.HealthPath

	// Nothing reported yet: an empty tree is healthy.
	if code, body := get(t, url); code != http.StatusOK {
		t.Fatalf("empty: %d %s", code, body)
	}

	mod := th.health.NewScope("allocator")
	job := mod.NewScope("job-gc")
	// A scope that has not said it is ready keeps the endpoint at 503.
	if code, body := get(t, url); code != http.StatusServiceUnavailable || !strings.Contains(body, "allocator.job-gc: level=Unknown") {
		t.Fatalf("unknown: %d %s", code, body)
	}
	job.OK("running")
	if code, body := get(t, url); code != http.StatusOK || !strings.Contains(body, `allocator.job-gc: level=OK message="running"`) {
		t.Fatalf("ok: %d %s", code, body)
	}
	job.Degraded("gc failed", errors.New("etcd unreachable"))
	code, body := get(t, url)
	if code != http.StatusServiceUnavailable || !strings.Contains(body, `error="etcd unreachable"`) {
		t.Fatalf("degraded: %d %s", code, body)
	}
	// Only the scope at fault is listed, not its parent.
	if strings.Contains(body, "allocator: level") {
		t.Errorf("parent listed as a cause:\n%s", body)
	}
	// A finished job leaves its module healthy, with nothing below it
	// running.
	job.OK("finished")
	job.Close()
	if code, body := get(t, url); code != http.StatusOK || !strings.Contains(body, `allocator.job-gc: level=Stopped message="finished"`) {
		t.Fatalf("finished job: %d %s", code, body)
	}
}

// /healthz is liveness and /readyz readiness: a scope Degraded for a cause
// outside the agent (etcd unreachable) turns only /readyz to 503, and both
// show it.
func TestReadyz(t *testing.T) {
	th := newHive(t, "127.0.0.1:0")
	if err := th.start(t); err != nil {
		t.Fatal(err)
	}
	live := "http://" + th.server.Addr() + metrics.HealthPath
	ready := "http://" + th.server.Addr() + metrics.ReadyPath

	kv := th.health.NewScope("kvstore")
	if code, body := get(t, ready); code != http.StatusServiceUnavailable || !strings.HasPrefix(body, "not ready: 1 health scopes not OK\nkvstore: level=Unknown") {
		t.Fatalf("unknown: %d %s", code, body)
	}
	kv.OK("connected")
	if code, body := get(t, ready); code != http.StatusOK || body != "ready\nkvstore: level=OK message=\"connected\"\n" {
		t.Fatalf("ok: %d %q", code, body)
	}
	kv.Degraded("etcd does not answer", health.External(errors.New("deadline exceeded")))
	line := `kvstore: level=Degraded message="etcd does not answer" error="deadline exceeded" cause=external`
	if code, body := get(t, ready); code != http.StatusServiceUnavailable || !strings.Contains(body, line) {
		t.Fatalf("readyz, external cause: %d %s", code, body)
	}
	if code, body := get(t, live); code != http.StatusOK || !strings.Contains(body, line) {
		t.Fatalf("healthz, external cause: %d %s", code, body)
	}
	kv.Degraded("lease refused", errors.New("bug"))
	if code, body := get(t, live); code != http.StatusServiceUnavailable {
		t.Fatalf("healthz, own fault: %d %s", code, body)
	}
	kv.OK("connected")
	for _, url := range []string{live, ready} {
		if code, body := get(t, url); code != http.StatusOK {
			t.Fatalf("%s after recovery: %d %s", url, code, body)
		}
	}
}

func TestMetricsEndpoint(t *testing.T) {
	hist := metrics.NewIdentityAllocationDuration()
	th := newHive(t, "127.0.0.1:0",
		cell.Provide(func() metrics.CollectorOut { return metrics.NewCollector(hist) }),
		// A cell that has nothing to contribute.
		cell.Provide(func() metrics.CollectorOut { return metrics.CollectorOut{} }),
	)
	if err := th.start(t); err != nil {
		t.Fatal(err)
	}
	hist.WithLabelValues("local", metrics.OutcomeSuccess).Observe(3e-6)
	code, body := get(t, "http://"+th.server.Addr()+metrics.MetricsPath)
	if code != http.StatusOK {
		t.Fatalf("%d %s", code, body)
	}
	for _, want := range []string{
		`identityd_identity_allocation_duration_seconds_bucket{outcome="success",scope="local",le="4e-06"} 1`,
		`identityd_identity_allocation_duration_seconds_count{outcome="success",scope="local"} 1`,
		"go_goroutines ",
		"process_start_time_seconds ",
		`promhttp_metric_handler_requests_total{code="200"} 0`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("missing %q", want)
		}
	}
	if code, _ := get(t, "http://"+th.server.Addr()+"/other"); code != http.StatusNotFound {
		t.Errorf("unknown path: %d", code)
	}
}

// The shared definitions register together without clashes.
func TestDefinitionsRegister(t *testing.T) {
	reg := prometheus.NewRegistry()
	for _, c := range []prometheus.Collector{
		metrics.NewIdentityAllocationDuration(),
		metrics.NewKVStoreOperationsDuration(),
		metrics.NewKVStoreQuorumErrors(),
		metrics.NewIdentityGCEntries(),
		metrics.NewIdentityGCRuns(),
		metrics.NewIdentityRestoration(),
	} {
		if err := reg.Register(c); err != nil {
			t.Fatal(err)
		}
	}
}

func TestDuplicateCollectorFailsClearly(t *testing.T) {
	th := newHive(t, "",
		cell.Provide(func() metrics.CollectorOut { return metrics.NewCollector(metrics.NewIdentityGCRuns()) }),
		cell.Module("other", "Other", cell.Provide(func() metrics.CollectorOut { return metrics.NewCollector(metrics.NewIdentityGCRuns()) })),
	)
	err := th.start(t)
	if err == nil || !strings.Contains(err.Error(), "metrics: registering collector") {
		t.Fatalf("got %v, want a registration error", err)
	}
}

func TestPortInUseFailsStart(t *testing.T) {
	first := newHive(t, "127.0.0.1:0")
	if err := first.start(t); err != nil {
		t.Fatal(err)
	}
	second := newHive(t, first.server.Addr())
	err := second.start(t)
	if err == nil || !strings.Contains(err.Error(), "metrics: listening on --prometheus-serve-addr "+first.server.Addr()) {
		t.Fatalf("got %v, want a listen error naming the flag", err)
	}
}

func TestDisabled(t *testing.T) {
	th := newHive(t, "")
	if err := th.start(t); err != nil {
		t.Fatal(err)
	}
	if th.server.Addr() != "" {
		t.Errorf("serving on %q with an empty address", th.server.Addr())
	}
	if th.reg == nil {
		t.Error("no registry")
	}
}

func TestInvalidFlag(t *testing.T) {
	th := newHive(t, "localhost")
	err := th.h.Populate(hivetest.Logger(t))
	if err == nil || !strings.Contains(err.Error(), "invalid --prometheus-serve-addr") {
		t.Fatalf("got %v", err)
	}
}

// TestScrapeCollector: the collector describes the metrics it was given
// and those it includes, reads its values at each scrape (not when it is
// built), and passes the registry's consistency checks.
func TestScrapeCollector(t *testing.T) {
	var n float64
	hits := metrics.NewDesc("test_hits_total", "Hits", "kind")
	level := metrics.NewDesc("test_level", "Level")
	events := prometheus.NewCounter(prometheus.CounterOpts{Namespace: metrics.Namespace, Name: "test_events_total", Help: "Events"})
	col := metrics.NewScrapeCollector(func(m metrics.Scrape) {
		m.Counter(hits, n, "a")
		m.Counter(hits, 2*n, "b")
		m.Gauge(level, n/2)
	}, hits, level).Include(events)
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(col); err != nil {
		t.Fatal(err)
	}
	n = 4
	events.Add(3)
	want := `# HELP identityd_test_events_total Events
# TYPE identityd_test_events_total counter
identityd_test_events_total 3
# HELP identityd_test_hits_total Hits
# TYPE identityd_test_hits_total counter
identityd_test_hits_total{kind="a"} 4
identityd_test_hits_total{kind="b"} 8
# HELP identityd_test_level Level
# TYPE identityd_test_level gauge
identityd_test_level 2
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want)); err != nil {
		t.Fatal(err)
	}
	n = 6
	again := `# HELP identityd_test_level Level
# TYPE identityd_test_level gauge
identityd_test_level 3
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(again), "identityd_test_level"); err != nil {
		t.Errorf("second scrape: %v", err)
	}
}
