package k8sclient

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/transport"
	"k8s.io/client-go/util/flowcontrol"

	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/identity"
)

var (
	// ErrNotStarted is returned by calls that need the API server before
	// the client's start hook ran.
	ErrNotStarted = errors.New("k8sclient: client is not started")
	// ErrNoAPIServer is the start's error when no flag names an API
	// server and the process does not run in a pod.
	ErrNoAPIServer = errors.New("no Kubernetes API server configured: set --k8s-kubeconfig-path or --k8s-api-server " +
		"(or run in a pod, where KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT name it)")
)

// userAgent is the User-Agent of every request, so that the API server's
// audit log and flow control name the client.
const userAgent = "identityd"

// Client is the agent's Kubernetes API client: the resolved connection
// settings, the node-wide rate limit, request metrics and health. It is
// provided by Cell and usable once its start hook has run (start hooks of
// cells that depend on it run later).
type Client struct {
	cfg     Config
	log     *slog.Logger
	metrics *requestMetrics
	health  cell.Health // nil outside a hive with a health provider
	// limiter is shared by every client built from RESTConfig, so that
	// --k8s-client-qps bounds the node, not each of its clients.
	limiter flowcontrol.RateLimiter

	mu     sync.Mutex
	base   *rest.Config // resolved at start; nil before
	source string       // where base came from, for logs and status
	// serverURL is the server's base URL, which every request path
	// extends; prefix is its path, stripped before naming a request.
	serverURL *url.URL
	prefix    string
	// httpClient makes the client's own requests (reachability, status);
	// it carries the same transport wrapper as RESTConfig's.
	httpClient *http.Client

	// lastAnswer is when (Unix nanoseconds) a request last got an answer
	// that proves the API server serves: it spares the connectivity job
	// its own request.
	lastAnswer atomic.Int64
	// stateMu orders the health reports with the outcomes they describe.
	stateMu sync.Mutex
	state   serverState
	lastErr string
	// stateNow is state, readable without stateMu.
	stateNow atomic.Int32
}

// serverState is what the last request said of the API server.
type serverState int

const (
	stateUnknown serverState = iota
	stateAnswering
	stateFailing
)

type params struct {
	cell.In

	Lifecycle cell.Lifecycle
	Log       *slog.Logger
	Config    Config
	// Mode is the identity allocation mode; the client is needed in crd
	// mode. Absent in a hive without mode selection.
	Mode   identity.AllocationMode `optional:"true"`
	Health cell.Health             `optional:"true"`
	// Jobs runs the connectivity check that keeps Health in step with the
	// API server while no other request is made.
	Jobs job.Registry `optional:"true"`
}

// newClient provides the client only when something needs it: in crd
// mode and the double-write modes, or when a flag names an API server. Otherwise it provides nil and
// the agent opens no connection (nor reads any kubeconfig).
func newClient(p params) (*Client, error) {
	// Bad values are errors even when the client is not needed: a typo
	// must not wait for the day the mode changes.
	if err := p.Config.Validate(); err != nil {
		return nil, fmt.Errorf("k8sclient: %w", err)
	}
	if !p.Mode.UsesCRD() && !p.Config.Configured() {
		if p.Health != nil {
			// Nothing else reports to the module then; a scope that never
			// reports reads as unknown and fails /healthz.
			p.Health.OK("Not used: not in a mode that uses CRDs and no --k8s-* flag names an API server")
		}
		return nil, nil
	}
	c, err := New(p.Log, p.Config)
	if err != nil {
		return nil, err
	}
	c.health = p.Health
	p.Lifecycle.Append(c)
	if p.Health != nil && p.Jobs != nil {
		// Added after the client's hook: the job starts once the client
		// is connected.
		p.Jobs.NewGroup(p.Health).Add(job.OneShot("k8s-connectivity", c.watchConnectivity))
	}
	return c, nil
}

// New returns a client for cfg without starting it; call Start and Stop
// (hive does this for the Client provided by Cell).
func New(log *slog.Logger, cfg Config) (*Client, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("k8sclient: %w", err)
	}
	c := &Client{cfg: cfg, log: log, metrics: newRequestMetrics()}
	if cfg.K8sClientQPS > 0 {
		c.limiter = flowcontrol.NewTokenBucketRateLimiter(float32(cfg.K8sClientQPS), cfg.burst())
	} else {
		c.limiter = unlimited{}
	}
	return c, nil
}

// unlimited is the rate limiter of --k8s-client-qps 0: it never waits.
// client-go would otherwise apply its default of 5 requests per second to
// a config whose QPS is 0.
type unlimited struct{}

func (unlimited) TryAccept() bool            { return true }
func (unlimited) Accept()                    {}
func (unlimited) Stop()                      {}
func (unlimited) QPS() float32               { return 0 }
func (unlimited) Wait(context.Context) error { return nil }

// RESTConfig returns a copy of the connection settings for building
// clients (typed, dynamic, informers), with the node's rate limiter and a
// transport wrapper that counts, times and bounds every request
// (--k8s-request-timeout, watches excepted). Its QPS and Burst are the
// limiter's; with --k8s-client-qps 0 QPS is -1, client-go's "no limit".
// nil before the start hook ran, or after it failed.
func (c *Client) RESTConfig() *rest.Config {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.base == nil {
		return nil
	}
	return rest.CopyConfig(c.base)
}

// endpoint is the URL of one of the server's paths (readyz, version);
// empty before the start.
func (c *Client) endpoint(path string) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.serverURL == nil {
		return ""
	}
	return c.serverURL.JoinPath(path).String()
}

// Server is the API server's URL; empty before the start.
func (c *Client) Server() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.base == nil {
		return ""
	}
	return c.base.Host
}

// RequestTimeout is --k8s-request-timeout, the bound the transport gives
// every request but watches.
func (c *Client) RequestTimeout() time.Duration { return c.cfg.K8sRequestTimeout }

// Start resolves the connection settings (kubeconfig and/or API server
// flag, else the in-cluster config) and checks that the API server is
// ready and lets the credentials in (/readyz, then /version), within
// --k8s-request-timeout and the hook's deadline.
func (c *Client) Start(ctx cell.HookContext) error {
	base, source, err := c.resolve()
	if err != nil {
		return fmt.Errorf("k8sclient: %w", err)
	}
	base.UserAgent = userAgent
	base.RateLimiter = c.limiter
	// QPS and Burst say what the limiter does to whoever reads them; a
	// negative QPS is client-go's own "no limit", should a client drop
	// the shared limiter.
	base.QPS, base.Burst = float32(c.cfg.K8sClientQPS), c.cfg.burst()
	if c.cfg.K8sClientQPS == 0 {
		base.QPS, base.Burst = -1, 0
	}
	base.WarningHandlerWithContext = warningLogger{c.log}
	base.WrapTransport = transport.Wrappers(base.WrapTransport, c.wrapTransport)
	serverURL, _, err := rest.DefaultServerUrlFor(base)
	if err != nil {
		return fmt.Errorf("k8sclient: API server %q from %s: %w", base.Host, source, err)
	}
	httpClient, err := rest.HTTPClientFor(base)
	if err != nil {
		return fmt.Errorf("k8sclient: API server %s from %s: %w", base.Host, source, err)
	}
	c.mu.Lock()
	c.base, c.source, c.httpClient, c.serverURL = base, source, httpClient, serverURL
	c.prefix = strings.TrimSuffix(serverURL.Path, "/")
	c.mu.Unlock()

	version, err := c.checkReachable(ctx, serverURL)
	if err != nil {
		c.closeIdle()
		// A client whose start failed hands out no settings.
		c.mu.Lock()
		c.base, c.httpClient, c.serverURL = nil, nil, nil
		c.mu.Unlock()
		return err
	}
	c.log.Info("Connected to the Kubernetes API server", "server", base.Host, "version", version,
		"config", source, "qps", c.cfg.K8sClientQPS, "burst", base.Burst)
	c.reportHealth()
	return nil
}

// Stop closes the idle connections, which would otherwise stay open
// until the server closes them: the transport is shared by the clients
// built from RESTConfig (client-go caches it by TLS settings).
func (c *Client) Stop(cell.HookContext) error {
	c.closeIdle()
	return nil
}

func (c *Client) closeIdle() {
	c.mu.Lock()
	hc := c.httpClient
	c.mu.Unlock()
	if hc != nil {
		utilnet.CloseIdleConnectionsFor(hc.Transport)
	}
}

// resolve finds the connection settings the way Cilium does: the
// kubeconfig (with --k8s-api-server replacing its server), else
// --k8s-api-server alone, else the in-cluster config.
func (c *Client) resolve() (*rest.Config, string, error) {
	path, server := c.cfg.K8sKubeconfigPath, c.cfg.K8sAPIServer
	switch {
	case path != "":
		// Read once first: clientcmd's errors do not always name the
		// file, and an unreadable one must say which.
		if _, err := os.ReadFile(path); err != nil {
			return nil, "", fmt.Errorf("reading --k8s-kubeconfig-path: %w", err)
		}
		overrides := &clientcmd.ConfigOverrides{}
		if server != "" {
			overrides.ClusterInfo.Server = server
		}
		cfg, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(
			&clientcmd.ClientConfigLoadingRules{ExplicitPath: path}, overrides).ClientConfig()
		if err != nil {
			return nil, "", fmt.Errorf("--k8s-kubeconfig-path %s: %w", path, err)
		}
		source := "kubeconfig " + path
		if server != "" {
			source += " with --k8s-api-server"
		}
		return cfg, source, nil
	case server != "":
		// An https server in a pod uses the pod's service account, as in
		// Cilium; otherwise the server alone, without credentials.
		if strings.HasPrefix(server, "https://") && inCluster() {
			cfg, err := rest.InClusterConfig()
			if err != nil {
				return nil, "", fmt.Errorf("in-cluster credentials for --k8s-api-server %s: %w", server, err)
			}
			cfg.Host = server
			return cfg, "--k8s-api-server with the in-cluster service account", nil
		}
		return &rest.Config{Host: server}, "--k8s-api-server", nil
	default:
		if !inCluster() {
			return nil, "", ErrNoAPIServer
		}
		cfg, err := rest.InClusterConfig()
		if err != nil {
			return nil, "", fmt.Errorf("in-cluster config: %w", err)
		}
		return cfg, "in-cluster service account", nil
	}
}

func inCluster() bool {
	return os.Getenv("KUBERNETES_SERVICE_HOST") != "" && os.Getenv("KUBERNETES_SERVICE_PORT") != ""
}

// reachabilityRetry is the pause between two reachability checks at start
// while the API server refuses connections or is not ready yet.
const reachabilityRetry = 500 * time.Millisecond

// checkReachable asks /readyz until the API server answers "ok", then
// /version, within --k8s-request-timeout. /readyz is open to everyone who
// authenticates (or no one, on some servers): /version is the request that
// shows whether the server lets these credentials in, and it names the
// server's version in the log. Answers that waiting cannot change (TLS
// failures, 401, 403) fail at once; the others are retried, and the last
// one says why the start failed. It returns the server's gitVersion.
func (c *Client) checkReachable(ctx context.Context, serverURL *url.URL) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.K8sRequestTimeout)
	defer cancel()
	readyz := serverURL.JoinPath("readyz").String()
	version := serverURL.JoinPath("version").String()
	where := serverURL.Redacted()
	// cause is the last attempt's error that the deadline did not cut
	// short: the one that says why (refused, 503), not "deadline
	// exceeded" of an attempt begun just before the end.
	var cause error
	for {
		_, err := c.get(ctx, readyz)
		var body []byte
		if err == nil {
			body, err = c.get(ctx, version)
		}
		if err == nil {
			return gitVersion(body), nil
		}
		var final finalError
		if errors.As(err, &final) {
			return "", fmt.Errorf("k8sclient: API server at %s (%s): %w", where, c.source, err)
		}
		if ctx.Err() == nil || cause == nil {
			cause = err
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("k8sclient: API server at %s (%s) not ready within %s: %w",
				where, c.source, c.cfg.K8sRequestTimeout, cause)
		case <-time.After(reachabilityRetry):
		}
	}
}

// gitVersion is the server's version in a /version answer; empty when the
// answer does not say.
func gitVersion(body []byte) string {
	var info struct {
		GitVersion string `json:"gitVersion"`
	}
	if json.Unmarshal(body, &info) != nil {
		return ""
	}
	return info.GitVersion
}

// finalError marks a failure that a retry would not change.
type finalError struct{ error }

func (e finalError) Unwrap() error { return e.error }

// maxErrorBody bounds how much of an error answer goes into an error.
const maxErrorBody = 512

// get sends one GET with the client's own http client and returns the
// body of a 200 answer, or an error that names the cause.
func (c *Client) get(ctx context.Context, url string) ([]byte, error) {
	c.mu.Lock()
	hc := c.httpClient
	c.mu.Unlock()
	if hc == nil {
		return nil, ErrNotStarted
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, describeTransportError(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return nil, describeTransportError(err)
	}
	if resp.StatusCode == http.StatusOK {
		return body, nil
	}
	msg := answerMessage(body)
	switch resp.StatusCode {
	case http.StatusUnauthorized:
		return nil, finalError{fmt.Errorf("the credentials were refused (401 Unauthorized): %s", msg)}
	case http.StatusForbidden:
		return nil, finalError{fmt.Errorf("access denied (403 Forbidden): %s", msg)}
	}
	return nil, fmt.Errorf("answered %s: %s", resp.Status, msg)
}

// answerMessage is the message of an error answer: a Status object's
// message, else the body on one line, shortened.
func answerMessage(body []byte) string {
	var st struct {
		Kind    string `json:"kind"`
		Message string `json:"message"`
	}
	if json.Unmarshal(body, &st) == nil && st.Kind == "Status" && st.Message != "" {
		return st.Message
	}
	s := strings.Join(strings.Fields(string(body)), " ")
	if len(s) > maxErrorBody {
		s = s[:maxErrorBody] + "..."
	}
	if s == "" {
		s = "(empty answer)"
	}
	return s
}

// describeTransportError says why a request got no answer: TLS failures
// are final (waiting does not fix a certificate), refused connections and
// timeouts are not.
func describeTransportError(err error) error {
	switch errorReason(err) {
	case reasonTLS:
		return finalError{fmt.Errorf("TLS handshake failed: %w", err)}
	case reasonRefused:
		return fmt.Errorf("connection refused: %w", err)
	case reasonTimeout:
		return fmt.Errorf("no answer in time: %w", err)
	}
	return err
}

// Reasons of identityd_k8s_errors_total.
const (
	reasonTLS          = "tls"
	reasonRefused      = "refused"
	reasonTimeout      = "timeout"
	reasonCanceled     = "canceled"
	reasonConnection   = "connection"
	reasonUnauthorized = "unauthorized"
	reasonForbidden    = "forbidden"
	reasonThrottled    = "throttled"
	reasonServerError  = "server_error"
)

// errorReason classifies a request that got no answer.
func errorReason(err error) string {
	var (
		unknownAuthority x509.UnknownAuthorityError
		invalidCert      x509.CertificateInvalidError
		hostname         x509.HostnameError
		verification     *tls.CertificateVerificationError
		recordHeader     tls.RecordHeaderError
		alert            tls.AlertError
		timeout          interface{ Timeout() bool }
	)
	switch {
	case errors.As(err, &unknownAuthority), errors.As(err, &invalidCert), errors.As(err, &hostname),
		errors.As(err, &verification), errors.As(err, &recordHeader), errors.As(err, &alert):
		return reasonTLS
	case errors.Is(err, syscall.ECONNREFUSED):
		return reasonRefused
	case errors.Is(err, context.Canceled):
		return reasonCanceled
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &timeout) && timeout.Timeout():
		return reasonTimeout
	}
	return reasonConnection
}

// record notes a request's outcome for health and status: code is the
// HTTP status, 0 when err says why there was none.
func (c *Client) record(code int, err error) {
	var failure string
	switch {
	case err != nil:
		if errors.Is(err, context.Canceled) {
			// The caller gave up: nothing learned about the server.
			return
		}
		failure = describeTransportError(err).Error()
	case code == http.StatusUnauthorized:
		failure = "the credentials were refused (401 Unauthorized)"
	case code >= 500:
		failure = fmt.Sprintf("answered %d %s", code, http.StatusText(code))
	}
	if failure == "" {
		c.lastAnswer.Store(time.Now().UnixNano())
		if serverState(c.stateNow.Load()) == stateAnswering {
			// The common case, without the lock: nothing changes.
			return
		}
	}
	c.stateMu.Lock()
	defer c.stateMu.Unlock()
	prev := c.state
	if failure == "" {
		c.state = stateAnswering
	} else {
		c.state, c.lastErr = stateFailing, failure
	}
	c.stateNow.Store(int32(c.state))
	if prev != c.state {
		c.reportHealthLocked()
	}
}

// reportHealth tells health what the last request said of the API server.
func (c *Client) reportHealth() {
	c.stateMu.Lock()
	defer c.stateMu.Unlock()
	if c.state == stateUnknown {
		c.state = stateAnswering
		c.stateNow.Store(int32(c.state))
	}
	c.reportHealthLocked()
}

func (c *Client) reportHealthLocked() {
	if c.health == nil {
		return
	}
	server := c.Server()
	switch c.state {
	case stateAnswering:
		c.health.OK("Kubernetes API server answers at " + server)
	case stateFailing:
		// Mostly the server's or the network's doing: restarting the
		// agent would not help.
		c.health.Degraded("Kubernetes API server at "+server+" failed the last request",
			health.External(errors.New(c.lastErr)))
	}
}

// LastError is the last request failure, empty when none happened.
func (c *Client) LastError() string {
	c.stateMu.Lock()
	defer c.stateMu.Unlock()
	return c.lastErr
}

// warningLogger logs the API server's warnings (deprecations and such)
// through the agent's logger instead of klog's stderr.
type warningLogger struct{ log *slog.Logger }

func (w warningLogger) HandleWarningHeaderWithContext(_ context.Context, code int, _ string, text string) {
	if code != 299 || text == "" {
		return
	}
	w.log.Warn("Kubernetes API server warning", "warning", text)
}
