package metrics

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/identityd/identityd/cells/health"
)

// Paths served by Server.
const (
	MetricsPath = "/metrics"
	// HealthPath answers liveness: 503 only when the agent's own work
	// does not run (see health.Provider.Live).
	HealthPath = "/healthz"
	// ReadyPath answers readiness: 503 also while a cause outside the
	// agent, such as an unreachable etcd, keeps it from its work (see
	// health.Provider.Healthy).
	ReadyPath = "/readyz"
)

// readHeaderTimeout bounds how long a client may take to send its request
// headers, so idle or malicious connections cannot pile up.
const readHeaderTimeout = 10 * time.Second

// ServeJob is the name of the job that serves the endpoint; its health
// scope is "job-" + ServeJob in the metrics module.
const ServeJob = "serve-http"

// Server serves /metrics, /healthz and /readyz. It listens in its start
// hook, serves in the job ServeJob, and lets requests in flight finish in
// its stop hook.
type Server struct {
	log    *slog.Logger
	cfg    Config
	health *health.Provider

	mu      sync.Mutex
	handler http.Handler // nil until serveRegistry
	srv     *http.Server
	ln      net.Listener
	addr    net.Addr
	// inJob: the job ServeJob serves. Without a job registry or a health
	// provider the server serves in a goroutine of its own, which ends at
	// the stop hook's Shutdown and closes done.
	inJob bool
	done  chan struct{}
}

type serverParams struct {
	cell.In

	Config    Config
	Log       *slog.Logger
	Lifecycle cell.Lifecycle
	Jobs      job.Registry `optional:"true"`
	// Scope is the module's health scope, where the serve job reports.
	Scope cell.Health `optional:"true"`
	// Health is optional: a hive with another cell.Health provider still
	// gets /metrics, and /healthz then only says the process is up.
	Health *health.Provider `optional:"true"`
}

func newServer(p serverParams) (*Server, error) {
	if err := p.Config.Validate(); err != nil {
		return nil, err
	}
	s := &Server{log: p.Log, cfg: p.Config, health: p.Health}
	if p.Config.PrometheusServeAddr != "" {
		p.Lifecycle.Append(s)
		if p.Jobs != nil && p.Scope != nil {
			// Queued after the hook: the job starts once the server
			// listens and stops right before the hook.
			s.inJob = true
			p.Jobs.NewGroup(p.Scope).Add(job.OneShot(ServeJob, s.serve))
		}
	}
	return s, nil
}

// serveRegistry sets the registry to serve. It is called once, before the
// hive starts.
func (s *Server) serveRegistry(reg *prometheus.Registry) {
	if s.cfg.PrometheusServeAddr == "" {
		return
	}
	h := NewHandler(reg, s.health, s.log)
	s.mu.Lock()
	s.handler = h
	s.mu.Unlock()
}

// ServeHTTP serves the endpoint's paths.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	h := s.handler
	s.mu.Unlock()
	if h == nil {
		http.Error(w, "metrics: no registry to serve", http.StatusServiceUnavailable)
		return
	}
	h.ServeHTTP(w, r)
}

// NewHandler returns the HTTP handler of the endpoint: reg on MetricsPath,
// the health of h on HealthPath (h may be nil). The promhttp handler's own
// metrics are registered in reg, so call it once per registry.
func NewHandler(reg *prometheus.Registry, h *health.Provider, log *slog.Logger) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET "+MetricsPath, promhttp.InstrumentMetricHandler(reg,
		promhttp.HandlerFor(reg, promhttp.HandlerOpts{
			ErrorLog: slogPrinter{log},
			// A failing collector must not hide every other metric.
			ErrorHandling: promhttp.ContinueOnError,
		})))
	mux.Handle("GET "+HealthPath, healthHandler(h, "ok", "unhealthy", (*health.Provider).Live))
	mux.Handle("GET "+ReadyPath, healthHandler(h, "ready", "not ready", (*health.Provider).Healthy))
	return mux
}

// healthHandler answers 200 when check passes and 503 otherwise, with one
// line per scope (every scope when it passes, the ones at fault when it
// does not), so that a probe and a human read the same thing.
func healthHandler(h *health.Provider, good, bad string, check func(*health.Provider) (bool, []health.Status)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("Cache-Control", "no-store")
		if h == nil {
			fmt.Fprintln(w, good+": no health provider in this hive, only liveness is reported")
			return
		}
		ok, faults := check(h)
		if !ok {
			w.WriteHeader(http.StatusServiceUnavailable)
			fmt.Fprintf(w, "%s: %d health scopes not OK\n%s", bad, len(faults), health.Format(faults))
			return
		}
		fmt.Fprintf(w, "%s\n%s", good, health.Format(h.All()))
	})
}

// Start implements cell.HookInterface. It listens before returning so that
// an address in use fails the agent's start with a clear error instead of
// a log line nobody reads.
func (s *Server) Start(cell.HookContext) error {
	ln, err := net.Listen("tcp", s.cfg.PrometheusServeAddr)
	if err != nil {
		return fmt.Errorf("metrics: listening on --prometheus-serve-addr %s: %w", s.cfg.PrometheusServeAddr, err)
	}
	srv := &http.Server{
		Handler:           s,
		ReadHeaderTimeout: readHeaderTimeout,
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
	}
	s.mu.Lock()
	s.srv, s.ln, s.addr = srv, ln, ln.Addr()
	s.mu.Unlock()
	if !s.inJob {
		done := make(chan struct{})
		s.done = done
		go func() {
			defer close(done)
			s.serveUntilShutdown(srv, ln)
		}()
	}
	s.log.Info("Serving metrics and health", "address", ln.Addr().String(),
		"metrics", MetricsPath, "health", HealthPath, "ready", ReadyPath)
	return nil
}

// serve is the job ServeJob. When its context ends it stops accepting
// connections and returns; the requests in flight go on until the stop
// hook's Shutdown, which waits for them until the stop context ends.
func (s *Server) serve(ctx context.Context, h cell.Health) error {
	s.mu.Lock()
	srv, ln := s.srv, s.ln
	s.mu.Unlock()
	if srv == nil {
		return nil
	}
	// Shutdown with an ended context closes the listener and the idle
	// connections and returns at once, which ends Serve.
	closed := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		defer close(closed)
		srv.Shutdown(ctx)
	})
	h.OK("Serving on " + ln.Addr().String())
	err := s.serveUntilShutdown(srv, ln)
	if !stop() {
		<-closed
	}
	return err
}

// serveUntilShutdown serves until Shutdown or a failure, which it logs.
func (s *Server) serveUntilShutdown(srv *http.Server, ln net.Listener) error {
	err := srv.Serve(ln)
	if err == nil || errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	s.log.Error("Metrics server failed", "address", ln.Addr().String(), "error", err)
	return fmt.Errorf("serving on %s: %w", ln.Addr(), err)
}

// Stop implements cell.HookInterface: it lets scrapes in flight finish
// until the stop context ends, then closes what is left.
func (s *Server) Stop(ctx cell.HookContext) error {
	s.mu.Lock()
	srv, done := s.srv, s.done
	s.srv, s.ln, s.addr, s.done = nil, nil, nil, nil
	s.mu.Unlock()
	if srv == nil {
		return nil
	}
	err := srv.Shutdown(ctx)
	if err != nil {
		err = errors.Join(fmt.Errorf("metrics: shutting down: %w", err), srv.Close())
	}
	if done != nil {
		<-done
	}
	return err
}

// Addr returns the address the server listens on (with the actual port
// when the configured one was 0), or "" when it is not serving.
func (s *Server) Addr() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.addr == nil {
		return ""
	}
	return s.addr.String()
}

// slogPrinter adapts a logger to promhttp's error log.
type slogPrinter struct{ log *slog.Logger }

func (p slogPrinter) Println(v ...any) {
	p.log.Warn("Metrics collection failed", "error", fmt.Sprint(v...))
}
