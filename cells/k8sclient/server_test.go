package k8sclient_test

import (
	"context"
	"net"
	"net/url"

	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/k8sclient"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/eventually"
	"github.com/identityd/identityd/internal/k8stest"
)

// crds is the resource every API server of the tests serves.
var crds = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

const crdsResource = "customresourcedefinitions.apiextensions.k8s.io"

func startNodeOn(t *testing.T, configure func(*k8sclient.Config)) *node {
	t.Helper()
	noCluster(t)
	n := newNode(t, identity.AllocationModeCRD, configure)
	if err := n.start(); err != nil {
		t.Fatalf("start: %v", err)
	}
	return n
}

func dynamicClient(t *testing.T, n *node) *dynamic.DynamicClient {
	t.Helper()
	cfg := n.client.RESTConfig()
	if cfg == nil {
		t.Fatal("RESTConfig() is nil after the start")
	}
	dc, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return dc
}

// TestKubeconfigFlag: --k8s-kubeconfig-path alone reaches the server with
// the kubeconfig's credentials, and clients built from RESTConfig work.
func TestKubeconfigFlag(t *testing.T) {
	srv := k8stest.Start(t)
	n := startNodeOn(t, func(c *k8sclient.Config) { c.K8sKubeconfigPath = srv.Kubeconfig() })
	if got := n.client.Server(); got != srv.URL() {
		t.Errorf("Server() = %q, want %q", got, srv.URL())
	}
	if _, err := dynamicClient(t, n).Resource(crds).List(t.Context(), metav1.ListOptions{}); err != nil {
		t.Fatalf("list through RESTConfig: %v", err)
	}
	// qps 0: client-go's "no limit" and a limiter that never waits.
	if cfg := n.client.RESTConfig(); cfg.QPS != -1 || cfg.RateLimiter == nil || cfg.RateLimiter.QPS() != 0 || cfg.UserAgent != "identityd" {
		t.Errorf("RESTConfig() QPS %v, RateLimiter %v, UserAgent %q; want -1, one that never waits, identityd", cfg.QPS, cfg.RateLimiter, cfg.UserAgent)
	}
	st := n.client.Status(t.Context())
	if !st.Connected || !strings.HasPrefix(st.Version, "v") || st.Source != "kubeconfig "+srv.Kubeconfig() {
		t.Errorf("Status() = %+v, want connected with a version, from the kubeconfig", st)
	}
}

// TestAPIServerFlag: --k8s-api-server replaces the kubeconfig's server;
// alone (no credentials, no CA) it fails the start at once with the TLS
// cause.
func TestAPIServerFlag(t *testing.T) {
	srv := k8stest.Start(t)
	// A kubeconfig whose server is wrong: only the flag makes it work.
	cfg, err := clientcmd.LoadFromFile(srv.Kubeconfig())
	if err != nil {
		t.Fatal(err)
	}
	for _, cluster := range cfg.Clusters {
		cluster.Server = "https://127.0.0.1:1"
	}
	wrong := filepath.Join(t.TempDir(), "wrong-server.kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, wrong); err != nil {
		t.Fatal(err)
	}
	n := startNodeOn(t, func(c *k8sclient.Config) {
		c.K8sKubeconfigPath = wrong
		c.K8sAPIServer = srv.URL()
	})
	if _, err := dynamicClient(t, n).Resource(crds).List(t.Context(), metav1.ListOptions{}); err != nil {
		t.Fatalf("list: %v", err)
	}

	// A request timeout far above what a TLS failure takes even on a
	// loaded machine: the start must fail on the handshake, not on it.
	const timeout = 2 * time.Minute
	alone := newNode(t, identity.AllocationModeCRD, func(c *k8sclient.Config) {
		c.K8sAPIServer = srv.URL()
		c.K8sRequestTimeout = timeout
	})
	began := time.Now()
	err = alone.start()
	if err == nil {
		t.Fatal("start with --k8s-api-server alone succeeded without the server's CA")
	}
	t.Logf("after %s: %v", time.Since(began), err)
	for _, want := range []string{srv.URL(), "TLS handshake failed", "certificate"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("start error %q does not say %q", err, want)
		}
	}
	if took := time.Since(began); took > timeout/4 {
		t.Errorf("a TLS failure took %s to fail the start; it should not wait for the request timeout (%s)", took, timeout)
	}
}

// TestDeniedUserFailsStart: a user the server forbids everything fails
// the start at once, with the server, the user and the 403 in the error.
func TestDeniedUserFailsStart(t *testing.T) {
	srv := k8stest.Start(t)
	// Kubernetes lets every user read /version and the health checks
	// (the bindings system:public-info-viewer and system:discovery, which
	// the server restores only when it starts): without them, RBAC
	// forbids this user everything.
	admin, err := dynamic.NewForConfig(srv.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	bindings := schema.GroupVersionResource{Group: "rbac.authorization.k8s.io", Version: "v1", Resource: "clusterrolebindings"}
	for _, name := range []string{"system:public-info-viewer", "system:discovery"} {
		if err := admin.Resource(bindings).Delete(t.Context(), name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	user := srv.UserKubeconfig(t, "nobody")
	// The authorizer reads the bindings from its informers: a moment later.
	userCfg, err := clientcmd.BuildConfigFromFlags("", user)
	if err != nil {
		t.Fatal(err)
	}
	eventually.Within(t, 30*time.Second, "the user is forbidden /version", func() bool {
		_, err := k8stest.GetRaw(t.Context(), userCfg, "/version")
		return err != nil && strings.Contains(err.Error(), "403")
	})
	n := newNode(t, identity.AllocationModeCRD, func(c *k8sclient.Config) {
		c.K8sKubeconfigPath = user
	})
	noCluster(t)
	err = n.start()
	if err == nil {
		t.Fatal("start succeeded for a denied user")
	}
	t.Log(err)
	for _, want := range []string{srv.URL(), "403 Forbidden", `"nobody"`} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("start error %q does not say %q", err, want)
		}
	}
}

// TestStoppedServerFailsStart: with the server stopped the start fails
// within --k8s-request-timeout, saying the connection was refused.
func TestStoppedServerFailsStart(t *testing.T) {
	srv := k8stest.Start(t)
	srv.Stop(t)
	n := newNode(t, identity.AllocationModeCRD, func(c *k8sclient.Config) {
		c.K8sKubeconfigPath = srv.Kubeconfig()
		c.K8sRequestTimeout = 3 * time.Second
	})
	noCluster(t)
	began := time.Now()
	err := n.start()
	took := time.Since(began)
	if err == nil {
		t.Fatal("start succeeded with the server stopped")
	}
	if cfg := n.client.RESTConfig(); cfg != nil {
		t.Errorf("RESTConfig() after a failed start is for %s, want nil", cfg.Host)
	}
	t.Logf("after %s: %v", took, err)
	for _, want := range []string{srv.URL(), "not ready within 3s", "connection refused"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("start error %q does not say %q", err, want)
		}
	}
	if took > 20*time.Second {
		t.Errorf("start took %s, want about 3s", took)
	}
}

// metricValue is the value of the sample of name whose labels include
// labels (a counter's or gauge's value, a histogram's sample count); 0
// when there is none.
func metricValue(t *testing.T, n *node, name string, labels map[string]string) float64 {
	t.Helper()
	families, err := n.registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	metrics:
		for _, m := range f.GetMetric() {
			have := map[string]string{}
			for _, l := range m.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			for k, v := range labels {
				if have[k] != v {
					continue metrics
				}
			}
			sum += sampleValue(m)
		}
	}
	return sum
}

func sampleValue(m *dto.Metric) float64 {
	switch {
	case m.Counter != nil:
		return m.Counter.GetValue()
	case m.Gauge != nil:
		return m.Gauge.GetValue()
	case m.Histogram != nil:
		return float64(m.Histogram.GetSampleCount())
	}
	return 0
}

// moduleHealth is the k8s-client module's own health line.
func moduleHealth(n *node) string {
	for _, st := range n.health.All() {
		if st.Name == "k8s-client" {
			return health.Format([]health.Status{st})
		}
	}
	return "(no k8s-client scope)"
}

// TestMetricsAndHealthFollowRequests: real requests are counted by verb,
// resource and code and timed; a request to a stopped server counts as an
// error and degrades health, which the connectivity job turns OK once the
// server is back.
func TestMetricsAndHealthFollowRequests(t *testing.T) {
	srv := k8stest.Start(t)
	n := startNodeOn(t, func(c *k8sclient.Config) {
		c.K8sKubeconfigPath = srv.Kubeconfig()
		c.K8sRequestTimeout = 5 * time.Second
	})
	dc := dynamicClient(t, n).Resource(crds)
	ctx := t.Context()

	// The start's checks.
	for _, path := range []string{"/readyz", "/version"} {
		if got := metricValue(t, n, "identityd_k8s_requests_total", map[string]string{"verb": "get", "resource": path, "code": "200"}); got < 1 {
			t.Errorf("requests_total for the start's %s: %v, want at least 1", path, got)
		}
	}
	if _, err := dc.List(ctx, metav1.ListOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := dc.Get(ctx, "nothing.example.com", metav1.GetOptions{}); !errors.IsNotFound(err) {
		t.Fatalf("get of a missing CRD: %v, want NotFound", err)
	}
	list := map[string]string{"verb": "list", "resource": crdsResource}
	get := map[string]string{"verb": "get", "resource": crdsResource}
	for _, tt := range []struct {
		name   string
		labels map[string]string
		extra  map[string]string
		want   float64
	}{
		{"identityd_k8s_requests_total", list, map[string]string{"code": "200"}, 1},
		{"identityd_k8s_requests_total", get, map[string]string{"code": "404"}, 1},
		{"identityd_k8s_operations_duration_seconds", list, map[string]string{"outcome": "success"}, 1},
		{"identityd_k8s_operations_duration_seconds", get, map[string]string{"outcome": "failure"}, 1},
		// A 404 is an answer, not an error of the server.
		{"identityd_k8s_errors_total", get, nil, 0},
		{"identityd_k8s_connected", nil, nil, 1},
	} {
		labels := map[string]string{}
		for k, v := range tt.labels {
			labels[k] = v
		}
		for k, v := range tt.extra {
			labels[k] = v
		}
		if got := metricValue(t, n, tt.name, labels); got != tt.want {
			t.Errorf("%s%v = %v, want %v", tt.name, labels, got, tt.want)
		}
	}
	if h := moduleHealth(n); !strings.Contains(h, "level=OK") {
		t.Errorf("health after answered requests: %s", h)
	}

	srv.Stop(t)
	if _, err := dc.List(ctx, metav1.ListOptions{}); err == nil {
		t.Fatal("list with the server stopped succeeded")
	}
	if got := metricValue(t, n, "identityd_k8s_requests_total", map[string]string{"verb": "list", "resource": crdsResource, "code": "<error>"}); got < 1 {
		t.Errorf("requests_total{code=<error>} = %v after a refused list, want at least 1", got)
	}
	if got := metricValue(t, n, "identityd_k8s_errors_total", map[string]string{"verb": "list", "resource": crdsResource, "reason": "refused"}); got < 1 {
		t.Errorf("errors_total{reason=refused} = %v after a refused list, want at least 1", got)
	}
	if got := metricValue(t, n, "identityd_k8s_connected", nil); got != 0 {
		t.Errorf("connected = %v with the server stopped, want 0", got)
	}
	if h := moduleHealth(n); !strings.Contains(h, "level=Degraded") || !strings.Contains(h, "cause=external") {
		t.Errorf("health after a refused request: %s, want Degraded with cause=external", h)
	}

	// Back: the connectivity job notices without any request of ours.
	srv.Restart(t)
	deadline := time.Now().Add(60 * time.Second)
	for !strings.Contains(moduleHealth(n), "level=OK") {
		if time.Now().After(deadline) {
			t.Fatalf("health not OK 60s after the server's restart: %s", moduleHealth(n))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// parallelGets sends n GETs at once through a client of RESTConfig and
// returns how long they took together.
func parallelGets(t *testing.T, node *node, n int) time.Duration {
	t.Helper()
	dc := dynamicClient(t, node).Resource(crds)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, n)
	began := time.Now()
	for range n {
		wg.Go(func() {
			if _, err := dc.Get(ctx, "nothing.example.com", metav1.GetOptions{}); !errors.IsNotFound(err) {
				errs <- err
			}
		})
	}
	wg.Wait()
	took := time.Since(began)
	close(errs)
	for err := range errs {
		t.Fatalf("get: %v", err)
	}
	return took
}

// TestQPSZeroDoesNotThrottle: with --k8s-client-qps 0 (the default), 60
// requests in parallel finish well before client-go's default limiter for
// a zero QPS (5/s, burst 10) would let them (10s); with --k8s-client-qps 5
// the limiter holds them back.
func TestQPSZeroDoesNotThrottle(t *testing.T) {
	srv := k8stest.Start(t)
	const n = 60
	unlimited := startNodeOn(t, func(c *k8sclient.Config) { c.K8sKubeconfigPath = srv.Kubeconfig() })
	took := parallelGets(t, unlimited, n)
	t.Logf("qps 0: %d parallel requests in %s", n, took)
	// client-go's default would need (60-10)/5 = 10s.
	if took >= 10*time.Second {
		t.Errorf("qps 0: %d requests took %s, as long as a 5/s limiter needs", n, took)
	}

	limited := startNodeOn(t, func(c *k8sclient.Config) {
		c.K8sKubeconfigPath = srv.Kubeconfig()
		c.K8sClientQPS = 5
	})
	if cfg := limited.client.RESTConfig(); cfg.QPS != 5 || cfg.Burst != 5 || cfg.RateLimiter.QPS() != 5 {
		t.Errorf("qps 5: RESTConfig() QPS %v, Burst %d, limiter %v; want 5, 5 (ceil(qps)), 5", cfg.QPS, cfg.Burst, cfg.RateLimiter.QPS())
	}
	const m = 15
	took = parallelGets(t, limited, m)
	t.Logf("qps 5: %d parallel requests in %s", m, took)
	// A burst of 5, then 10 more at 5/s: at least 2s.
	if took < 1900*time.Millisecond {
		t.Errorf("qps 5: %d requests took %s, faster than the limit allows", m, took)
	}
}

// pausableProxy forwards TCP connections to a server until paused; then
// it forwards nothing more, on open connections or new ones, as a server
// that hangs with its connections open.
type pausableProxy struct {
	l      net.Listener
	target string
	wg     sync.WaitGroup
	done   chan struct{}

	mu     sync.Mutex
	paused bool
	conns  []net.Conn
}

func startProxy(t *testing.T, target string) *pausableProxy {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &pausableProxy{l: l, target: target, done: make(chan struct{})}
	p.wg.Go(p.serve)
	t.Cleanup(func() {
		l.Close()
		close(p.done)
		p.mu.Lock()
		for _, c := range p.conns {
			c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p
}

func (p *pausableProxy) URL() string { return "https://" + p.l.Addr().String() }

func (p *pausableProxy) isPaused() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.paused
}

func (p *pausableProxy) track(c net.Conn) {
	p.mu.Lock()
	p.conns = append(p.conns, c)
	p.mu.Unlock()
}

func (p *pausableProxy) serve() {
	for {
		c, err := p.l.Accept()
		if err != nil {
			return
		}
		p.track(c)
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		p.track(up)
		p.wg.Go(func() { p.pipe(up, c) })
		p.wg.Go(func() { p.pipe(c, up) })
	}
}

// pipe copies src to dst until an error, or until paused: then it holds
// what it read until the test ends.
func (p *pausableProxy) pipe(dst, src net.Conn) {
	defer dst.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if p.isPaused() {
				<-p.done
				return
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (p *pausableProxy) pause() {
	p.mu.Lock()
	p.paused = true
	p.mu.Unlock()
}

// TestRequestTimeoutBoundsRequestsNotWatches: a request to a server that
// hangs ends after --k8s-request-timeout as a timeout error, while a watch
// lives longer than the timeout.
func TestRequestTimeoutBoundsRequestsNotWatches(t *testing.T) {
	srv := k8stest.Start(t)
	u, err := url.Parse(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	proxy := startProxy(t, u.Host)
	const timeout = 2 * time.Second
	n := startNodeOn(t, func(c *k8sclient.Config) {
		c.K8sKubeconfigPath = srv.Kubeconfig()
		c.K8sAPIServer = proxy.URL()
		c.K8sRequestTimeout = timeout
	})
	dc := dynamicClient(t, n).Resource(crds)

	w, err := dc.Watch(t.Context(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	select {
	case ev, ok := <-w.ResultChan():
		t.Fatalf("watch delivered %v (open: %v) within twice the request timeout, want it idle and open", ev.Type, ok)
	case <-time.After(2 * timeout):
	}

	proxy.pause()
	began := time.Now()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	_, err = dc.List(ctx, metav1.ListOptions{})
	took := time.Since(began)
	t.Logf("list against a hung server: after %s: %v", took, err)
	if err == nil {
		t.Fatal("list against a hung server succeeded")
	}
	// Without the bound the list would wait for HTTP/2's health check of
	// the connection (30s idle, then a 15s ping).
	if took > 8*time.Second {
		t.Errorf("list took %s with a %s request timeout", took, timeout)
	}
	if got := metricValue(t, n, "identityd_k8s_errors_total", map[string]string{"verb": "list", "resource": crdsResource, "reason": "timeout"}); got < 1 {
		t.Errorf("errors_total{reason=timeout} = %v after the hung list, want at least 1", got)
	}
}
