package kvstore

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap/zapcore"
	"golang.org/x/time/rate"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"

	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
)

var (
	// ErrNotStarted is returned by calls that need etcd before the
	// client's start hook ran.
	ErrNotStarted = errors.New("kvstore: client is not started")
	// ErrStopped is returned by calls made after the client stopped.
	ErrStopped = errors.New("kvstore: client is stopped")
)

// Client is the agent's etcd client: the connection, this node's data lease,
// request counting and client-side rate limiting. It is provided by Cell and
// usable once its start hook has run (start hooks of cells that depend on it
// run later).
type Client struct {
	cfg     Config
	log     *slog.Logger
	dir     *statedir.Dir
	limiter *rate.Limiter // nil: unlimited
	counts  sync.Map      // method name -> *atomic.Uint64
	metrics *requestMetrics
	health  cell.Health // nil outside a hive with a health provider

	// lastAnswer is when (Unix nanoseconds) a KV or lease request last
	// succeeded: proof that etcd answers, which spares the connectivity
	// job its own request.
	lastAnswer atomic.Int64
	// healthMu orders the module's health reports, so that the last one
	// says the state after the last change of the lease.
	healthMu sync.Mutex

	// grantMu serializes granting and revoking, so concurrent callers of
	// Lease share one lease instead of each granting their own.
	grantMu sync.Mutex

	mu        sync.Mutex
	cli       *clientv3.Client
	embedded  *embeddedEtcd
	endpoints []string
	lease     *nodeLease
	// granted holds the last leases this client granted, newest last:
	// keys found on one of them are this agent's own, written before
	// the lease was lost (see Granted).
	granted []clientv3.LeaseID
	// forgotten is the last lease forgotten as lost, so that LeaseLost
	// of it waits for its loss to be reported rather than returning at
	// once in the moment between the forgetting and the report.
	forgotten *nodeLease
	lastErr   error
	stopped   bool
	// lostLease is the lease that was lost (not revoked by this node)
	// while no new one has been granted yet, with why; 0 otherwise. The
	// connectivity job grants a new one once etcd answers, so that health
	// does not stay Degraded on a node that writes nothing for a while.
	lostLease clientv3.LeaseID
	lostWhy   string

	// leaseGranted wakes the keepalive loop when Lease granted a lease.
	leaseGranted chan struct{}
	// keepaliveJobs runs the keepalive loop as a hive job during each run
	// of the client: its lifecycle is started at the end of Start and
	// stopped in Stop after the client is closed, so that the loop watches
	// the lease until the lease's revoke (by the allocator's stop hook or
	// by Stop), whatever the order of the other cells' stop hooks. nil
	// outside a hive with a job registry and a health provider; the loop
	// then runs in a goroutine of wg.
	keepaliveJobs *cell.DefaultLifecycle
	wg            sync.WaitGroup

	// stop is the stop path's state of the current run (see StopBudget).
	stop atomic.Pointer[stopState]
}

// ReconnectMaxDelay bounds the pause between the client's attempts to
// reach an etcd that went away, so that the agent is back within seconds
// of etcd's return whatever the outage's length.
const ReconnectMaxDelay = 3 * time.Second

// StopBudget bounds the etcd requests of the stop path together: the first
// stop-path call of StopContext fixes a deadline this far ahead (or one
// --kvstore-request-timeout ahead, if that is shorter), and every later
// stop-path request, and every request still in flight made with
// RequestContext, ends at it. A reachable etcd answers the lease revoke in
// milliseconds; an unreachable one would otherwise make each request of the
// stop path wait a request timeout in turn, past hive's stop timeout. The
// node's lease covers what the stop could not do: its keys expire with the
// TTL.
const StopBudget = 3 * time.Second

// stopState is one run's stop path: whether it began, and its deadline.
type stopState struct {
	// stopping is closed when the stop began: when the hive's stop runs
	// its pre-stop hooks, or at the first StopContext call.
	stopping     chan struct{}
	stoppingOnce sync.Once
	// expired is cancelled at the deadline.
	expired context.Context
	expire  context.CancelFunc

	mu       sync.Mutex
	deadline time.Time // zero until the first StopContext call
	timer    *time.Timer
}

func newStopState() *stopState {
	s := &stopState{stopping: make(chan struct{})}
	// A signal that no goroutine runs on: RequestContext hooks its
	// requests to it. It is cancelled at the deadline or at the end of
	// the client's stop (end), whichever comes first.
	s.expired, s.expire = context.WithCancel(context.Background())
	return s
}

func (s *stopState) begin() { s.stoppingOnce.Do(func() { close(s.stopping) }) }

// end releases the state's timer and context once the client has stopped.
func (s *stopState) end() {
	s.begin()
	s.mu.Lock()
	if s.timer != nil {
		s.timer.Stop()
	}
	s.mu.Unlock()
	s.expire()
}

// nodeLease is one granted lease and its keepalive.
type nodeLease struct {
	id       clientv3.LeaseID
	lost     chan struct{}
	lostOnce sync.Once
	cancel   context.CancelFunc
	// responses is the keepalive's channel; it closes when the keepalive
	// ends.
	responses <-chan *clientv3.LeaseKeepAliveResponse
}

type params struct {
	cell.In

	Lifecycle cell.Lifecycle
	Log       *slog.Logger
	Config    Config
	// Mode is the configured --identity-allocation-mode (the allocator
	// cell provides it); a hive without it runs in kvstore mode.
	Mode   identity.AllocationMode `optional:"true"`
	Dir    *statedir.Dir           `optional:"true"`
	Health cell.Health             `optional:"true"`
	// Jobs runs the connectivity check that keeps Health in step with
	// etcd; without a registry (or without Health) there is no check.
	Jobs job.Registry `optional:"true"`
}

func newClient(p params) (*Client, error) {
	// An invalid configuration is refused by the module's own invoke
	// (checkConfig), not here: this constructor runs inside whichever
	// invoke first needs the client, another module's as often as not,
	// and hive's log names that invoke as the failing one.
	if p.Mode == identity.AllocationModeCRD && p.Config.Embedded() {
		// Identities live in the Kubernetes API server: an embedded etcd
		// would hold nothing anyone reads.
		if p.Config.Validate() != nil {
			return nil, nil
		}
		p.Log.Info("No etcd client and no embedded etcd: --identity-allocation-mode=crd keeps global identities in the Kubernetes API server, and --kvstore-endpoints is empty")
		if p.Health != nil {
			p.Health.OK("Not used: crd mode without --kvstore-endpoints")
		}
		return nil, nil
	}
	c, err := New(p.Log, p.Config, p.Dir)
	if p.Config.Validate() != nil {
		// Never started: checkConfig fails the hive before any start
		// hook runs.
		c, err = newUnchecked(p.Log, p.Config), nil
	}
	if err != nil {
		return nil, err
	}
	c.metrics = newRequestMetrics()
	c.health = p.Health
	p.Lifecycle.Append(c)
	if p.Health != nil && p.Jobs != nil {
		// Added after the client's hook: the job starts once the client
		// is connected and stops before it closes.
		p.Jobs.NewGroup(p.Health).Add(job.OneShot("etcd-connectivity", c.watchConnectivity))
		// The keepalive's job is in the client's own lifecycle (see
		// keepaliveJobs), not in the hive's: it must outlive every stop
		// hook that revokes the lease or writes with it.
		// Its hooks are logged at debug level unless slower than this,
		// as the agent's are.
		c.keepaliveJobs = &cell.DefaultLifecycle{LogThreshold: 100 * time.Millisecond}
		p.Jobs.WithLifecycle(c.keepaliveJobs).NewGroup(p.Health).
			Add(job.OneShot(KeepaliveJob, c.keepLeaseAlive))
	}
	// Runs before every normal stop hook, whatever the order of the
	// cells: releases in other cells' stop hooks know from the start that
	// the lease's revoke (or its TTL) takes care of this node's keys.
	p.Lifecycle.Append(stopMarker{c})
	return c, nil
}

// New returns a client for cfg without starting it; call Start and Stop
// (hive does this for the Client provided by Cell). dir is needed only for
// the embedded etcd.
func New(log *slog.Logger, cfg Config, dir *statedir.Dir) (*Client, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("kvstore: %w", err)
	}
	if cfg.Embedded() && dir == nil {
		return nil, errors.New("kvstore: the embedded etcd needs a state directory (add the statedir cell or set --kvstore-endpoints)")
	}
	c := newUnchecked(log, cfg)
	c.dir = dir
	return c, nil
}

// newUnchecked is New without the checks of cfg.
func newUnchecked(log *slog.Logger, cfg Config) *Client {
	cfg.NodeName = cfg.nodeName()
	c := &Client{cfg: cfg, log: log, leaseGranted: make(chan struct{}, 1)}
	c.stop.Store(newStopState())
	if cfg.KVStoreRateLimit > 0 {
		burst := max(1, int(math.Ceil(cfg.KVStoreRateLimit)))
		c.limiter = rate.NewLimiter(rate.Limit(cfg.KVStoreRateLimit), burst)
	}
	return c
}

// Start starts the embedded etcd when no endpoints are configured, connects,
// and checks within --kvstore-dial-timeout that etcd answers.
func (c *Client) Start(ctx cell.HookContext) error {
	// c.mu is not held while connecting: the request interceptor takes it.
	if c.Client() != nil {
		return errors.New("kvstore: client already started")
	}
	endpoints := c.cfg.KVStoreEndpoints
	var e *embeddedEtcd
	if c.cfg.Embedded() {
		var err error
		if e, err = startEmbedded(ctx, c.log, c.dir.Join("etcd"), c.dir.Join(embeddedTLSDir)); err != nil {
			return fmt.Errorf("kvstore: %w", err)
		}
		endpoints = []string{e.clientURL}
	}
	cli, err := c.connect(ctx, endpoints, e)
	if err != nil {
		if e != nil {
			e.stop()
		}
		return err
	}
	c.mu.Lock()
	c.cli, c.embedded, c.endpoints, c.stopped = cli, e, endpoints, false
	c.mu.Unlock()
	if isClosed(c.stop.Load().stopping) {
		// A client started again after a stop starts a new run.
		c.stop.Store(newStopState())
	}
	if c.keepaliveJobs != nil {
		if err := c.keepaliveJobs.Start(c.log, ctx); err != nil {
			// Starting a queued job cannot fail; should it, the client
			// must not run without its keepalive.
			c.Stop(ctx)
			return fmt.Errorf("kvstore: starting the lease keepalive: %w", err)
		}
	} else {
		// The loop ends when the client closes, in Stop.
		c.wg.Go(func() { c.keepLeaseAlive(cli.Ctx(), nil) })
	}
	c.log.Info("Connected to etcd", "endpoints", endpoints, "embedded", e != nil)
	c.reportHealth()
	return nil
}

// reportHealth tells health the client is connected and holds, or can get, its
// lease; or that its lease was lost and no new one granted yet.
func (c *Client) reportHealth() {
	if c.health == nil {
		return
	}
	c.healthMu.Lock()
	defer c.healthMu.Unlock()
	c.mu.Lock()
	lost, why := c.lostLease, c.lostWhy
	c.mu.Unlock()
	if lost != 0 {
		// Mostly etcd's doing (unreachable for the whole TTL): not a
		// reason to restart the agent.
		c.health.Degraded("Lost this node's etcd lease; its keys are written again with a new one",
			health.External(fmt.Errorf("lease %x: %s", int64(lost), why)))
		return
	}
	mode := "external etcd"
	if c.Embedded() {
		mode = "embedded etcd"
	}
	c.health.OK(fmt.Sprintf("Connected to %s at %s", mode, strings.Join(c.Endpoints(), ",")))
}

// connect dials endpoints: those of e when it is the embedded etcd, with
// the client certificate made for it.
func (c *Client) connect(ctx context.Context, endpoints []string, e *embeddedEtcd) (*clientv3.Client, error) {
	cfg := clientv3.Config{
		Endpoints:            endpoints,
		DialTimeout:          c.cfg.KVStoreDialTimeout,
		DialKeepAliveTime:    10 * time.Second,
		DialKeepAliveTimeout: 5 * time.Second,
		PermitWithoutStream:  true,
		Logger:               newZapLogger(c.log.With("component", "etcd-client"), zapcore.WarnLevel, nil),
		// The client outlives the start hook that dials it: its
		// goroutines end when Stop closes it, not when ctx ends.
		Context: context.WithoutCancel(ctx),
		DialOptions: []grpc.DialOption{
			grpc.WithChainUnaryInterceptor(c.unaryInterceptor),
			grpc.WithChainStreamInterceptor(c.streamInterceptor),
			// gRPC's own backoff between connection attempts grows to
			// two minutes: after an outage of a lease TTL the agent
			// would stay away for tens of seconds after etcd came
			// back, its lease lost and its node unready meanwhile.
			grpc.WithConnectParams(grpc.ConnectParams{
				Backoff:           backoff.Config{BaseDelay: time.Second, Multiplier: 1.6, Jitter: 0.2, MaxDelay: ReconnectMaxDelay},
				MinConnectTimeout: 20 * time.Second,
			}),
		},
	}
	if e != nil {
		cfg.TLS = e.clientTLS
	} else {
		tlsCfg, err := c.tlsConfig(endpoints)
		if err != nil {
			return nil, err
		}
		cfg.TLS = tlsCfg
	}
	if c.cfg.KVStoreUsername != "" {
		pw, err := os.ReadFile(c.cfg.KVStorePasswordFile)
		if err != nil {
			return nil, fmt.Errorf("kvstore: reading --kvstore-password-file: %w", err)
		}
		cfg.Username = c.cfg.KVStoreUsername
		cfg.Password = strings.TrimRight(string(pw), "\r\n")
	}

	where := strings.Join(endpoints, ",")
	dialCtx, cancel := context.WithTimeout(ctx, c.cfg.KVStoreDialTimeout)
	defer cancel()
	if e == nil {
		if err := checkTLS(dialCtx, endpoints, cfg.TLS); err != nil {
			return nil, err
		}
	}
	cli, err := clientv3.New(cfg)
	if err != nil {
		return nil, fmt.Errorf("kvstore: connecting to etcd at %s: %w", where, flatError{err})
	}
	// clientv3.New does not wait for a connection: ask every endpoint for
	// its status until one answers, bounded by the dial timeout, so that
	// an unreachable etcd fails the start instead of the first request.
	if err := c.probe(dialCtx, cli, endpoints); err != nil {
		cli.Close()
		// The probe's own error is mostly "deadline exceeded"; the last
		// attempt's error says why (refused, TLS, auth).
		c.mu.Lock()
		last := c.lastErr
		c.mu.Unlock()
		if last != nil && last.Error() != err.Error() {
			return nil, fmt.Errorf("kvstore: etcd at %s not reachable within %s: %w (last error: %s)",
				where, c.cfg.KVStoreDialTimeout, flatError{err}, flatError{errors.New(rpctypes.ErrorDesc(last))})
		}
		return nil, fmt.Errorf("kvstore: etcd at %s not reachable within %s: %w", where, c.cfg.KVStoreDialTimeout, flatError{err})
	}
	return cli, nil
}

func (c *Client) probe(ctx context.Context, cli *clientv3.Client, endpoints []string) error {
	// The first answer is enough: the others are cancelled, and waited
	// for, on return.
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	errs := make(chan error, len(endpoints))
	for _, ep := range endpoints {
		wg.Go(func() {
			_, err := cli.Status(ctx, ep)
			errs <- err
		})
	}
	var first error
	for range endpoints {
		err := <-errs
		if err == nil {
			return nil
		}
		if first == nil {
			first = err
		}
	}
	return first
}

func (c *Client) tlsConfig(endpoints []string) (*tls.Config, error) {
	secure := c.cfg.KVStoreCAFile != "" || c.cfg.KVStoreCertFile != ""
	for _, ep := range endpoints {
		if strings.HasPrefix(ep, "https://") || strings.HasPrefix(ep, "unixs://") {
			secure = true
		}
	}
	if !secure {
		return nil, nil
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if c.cfg.KVStoreCAFile != "" {
		ca, err := os.ReadFile(c.cfg.KVStoreCAFile)
		if err != nil {
			return nil, fmt.Errorf("kvstore: reading --kvstore-ca-file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(ca) {
			return nil, fmt.Errorf("kvstore: --kvstore-ca-file %s holds no PEM certificate", c.cfg.KVStoreCAFile)
		}
		cfg.RootCAs = pool
	}
	if c.cfg.KVStoreCertFile != "" {
		cert, err := tls.LoadX509KeyPair(c.cfg.KVStoreCertFile, c.cfg.KVStoreKeyFile)
		if err != nil {
			return nil, fmt.Errorf("kvstore: loading --kvstore-cert-file/--kvstore-key-file: %w", err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg, nil
}

// Stop revokes the node's lease, so that its keys vanish at once rather
// than after the TTL, closes the client and stops the embedded etcd. The
// revoke shares the stop path's deadline (StopBudget): with etcd gone the
// stop takes seconds, and the keys expire with the TTL.
func (c *Client) Stop(ctx cell.HookContext) error {
	st := c.stop.Load()
	defer st.end()
	sctx, cancel := c.StopContext(ctx)
	err := c.RevokeLease(sctx)
	cancel()
	if err != nil {
		c.log.Warn("Revoking the node's etcd lease failed; its keys expire with the TTL", "error", err, "ttl", c.cfg.KVStoreLeaseTTL)
	}
	c.mu.Lock()
	cli, e := c.cli, c.embedded
	c.stopped = true
	c.cli, c.embedded = nil, nil
	c.mu.Unlock()

	err = nil
	if cli != nil {
		err = cli.Close()
		if errors.Is(err, context.Canceled) {
			err = nil
		}
	}
	// Closing the client ended every keepalive stream; now the keepalive
	// loop ends.
	var jobErr error
	if c.keepaliveJobs != nil {
		jobErr = c.keepaliveJobs.Stop(c.log, ctx)
	}
	c.wg.Wait()
	if e != nil {
		e.stop()
	}
	if err != nil {
		return fmt.Errorf("kvstore: closing client: %w", err)
	}
	if jobErr != nil {
		return fmt.Errorf("kvstore: stopping the lease keepalive: %w", jobErr)
	}
	return nil
}

// stopMarker is the client's pre-stop hook: it marks the start of the
// hive's stop before any normal stop hook runs.
type stopMarker struct{ c *Client }

func (stopMarker) Start(cell.HookContext) error { return nil }

func (m stopMarker) Stop(cell.HookContext) error {
	m.c.stop.Load().begin()
	return nil
}

// PreStopHookMarker makes hive run Stop before the normal stop hooks.
func (stopMarker) PreStopHookMarker() {}

// Stopping returns a channel closed once the stop began: the hive's stop
// started (before any cell's stop hook runs) or StopContext was called.
// From then on, per-key deletes of keys on this node's lease are useless:
// the lease's revoke at stop removes them all at once, or its TTL does if
// etcd cannot be reached.
func (c *Client) Stopping() <-chan struct{} { return c.stop.Load().stopping }

// StopContext returns ctx bounded by the stop path's shared deadline. The
// first call fixes it StopBudget from now (or one request timeout, if
// shorter) and marks the stop begun; later calls share it, so that all the
// stop path's etcd requests together take at most that long.
func (c *Client) StopContext(ctx context.Context) (context.Context, context.CancelFunc) {
	st := c.stop.Load()
	st.begin()
	st.mu.Lock()
	if st.deadline.IsZero() {
		budget := min(StopBudget, c.cfg.KVStoreRequestTimeout)
		st.deadline = time.Now().Add(budget)
		st.timer = time.AfterFunc(budget, st.expire)
	}
	deadline := st.deadline
	st.mu.Unlock()
	return context.WithDeadline(ctx, deadline)
}

// RequestContext bounds one request: by --kvstore-request-timeout, and by
// the stop path's deadline once StopContext fixed it, so that a request
// still in flight when the agent stops does not hold the stop up.
func (c *Client) RequestContext(ctx context.Context) (context.Context, context.CancelFunc) {
	rctx, cancel := context.WithTimeout(ctx, c.cfg.KVStoreRequestTimeout)
	unhook := context.AfterFunc(c.stop.Load().expired, cancel)
	return rctx, func() {
		unhook()
		cancel()
	}
}

func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// Client returns the etcd client for transactions, reads and watches; nil
// before Start and after Stop. Requests made through it are counted and
// rate limited (see RequestCounts).
func (c *Client) Client() *clientv3.Client {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.cli
}

// NodeName is this node's name, the suffix of its reference keys.
func (c *Client) NodeName() string { return c.cfg.NodeName }

// Embedded reports whether the client talks to the embedded etcd.
func (c *Client) Embedded() bool { return c.cfg.Embedded() }

// Endpoints returns the etcd endpoints in use (the embedded etcd's address
// once started).
func (c *Client) Endpoints() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.endpoints == nil {
		return append([]string(nil), c.cfg.KVStoreEndpoints...)
	}
	return append([]string(nil), c.endpoints...)
}

// RequestTimeout is the configured timeout for one request.
func (c *Client) RequestTimeout() time.Duration { return c.cfg.KVStoreRequestTimeout }

// LeaseTTL is the TTL of the node's lease.
func (c *Client) LeaseTTL() time.Duration { return c.cfg.KVStoreLeaseTTL }

// Lease returns the node's data lease, granting it on first use (or after
// the previous one was lost) and keeping it alive until it is lost or
// revoked. Keys written with it vanish when the node stops or dies.
func (c *Client) Lease(ctx context.Context) (clientv3.LeaseID, error) {
	c.grantMu.Lock()
	defer c.grantMu.Unlock()

	c.mu.Lock()
	cli, cur, stopped := c.cli, c.lease, c.stopped
	c.mu.Unlock()
	switch {
	case cur != nil:
		return cur.id, nil
	case stopped:
		return 0, ErrStopped
	case cli == nil:
		return 0, ErrNotStarted
	}

	gctx, cancel := c.RequestContext(ctx)
	defer cancel()
	resp, err := cli.Grant(gctx, int64(c.cfg.KVStoreLeaseTTL/time.Second))
	if err != nil {
		return 0, fmt.Errorf("kvstore: granting lease: %w", err)
	}
	// The keepalive outlives the caller's context: it ends when the lease
	// is lost or revoked, or the client closes.
	kctx, kcancel := context.WithCancel(cli.Ctx())
	ch, err := cli.KeepAlive(kctx, resp.ID)
	if err != nil {
		kcancel()
		return 0, fmt.Errorf("kvstore: keeping lease %x alive: %w", int64(resp.ID), err)
	}
	l := &nodeLease{id: resp.ID, lost: make(chan struct{}), cancel: kcancel, responses: ch}
	c.mu.Lock()
	c.lease = l
	c.lostLease, c.lostWhy = 0, ""
	if len(c.granted) == grantedKept {
		c.granted = append(c.granted[:0], c.granted[1:]...)
	}
	c.granted = append(c.granted, l.id)
	c.mu.Unlock()
	select {
	case c.leaseGranted <- struct{}{}:
	default: // a wake is pending: the loop reads the current lease
	}
	c.log.Debug("Granted etcd lease", "lease", fmt.Sprintf("%x", int64(l.id)), "ttl", c.cfg.KVStoreLeaseTTL)
	c.reportHealth()
	return l.id, nil
}

// grantedKept is how many of its last leases a client remembers as its
// own. A lease outlives its loss on this side only until etcd expires it,
// one TTL after etcd serves again, by which time the client has granted
// one new lease, not several.
const grantedKept = 8

// Granted reports whether this client granted lease id in one of its last
// few grants (this run's or an earlier one's). A lease this side took for
// lost may live on in etcd: the keepalive gave up when etcd did not answer
// for a TTL, but etcd, once it serves again, gives its leases a full TTL
// anew. Keys on such a lease are this agent's own, not another agent's.
func (c *Client) Granted(id clientv3.LeaseID) bool {
	if id == 0 {
		return false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Contains(c.granted, id)
}

// KeepaliveJob is the name of the job that consumes the keepalive answers
// of this node's lease and notices when the keepalive ends; its health
// scope is "job-" + KeepaliveJob in the kvstore module.
const KeepaliveJob = "etcd-lease-keepalive"

// keepLeaseAlive is the keepalive loop of one run of the client: it takes
// each lease Lease grants, consumes its keepalive answers, and marks the
// lease lost when its keepalive ends. h is nil outside a job.
func (c *Client) keepLeaseAlive(ctx context.Context, h cell.Health) error {
	report := func(l *nodeLease) {
		switch {
		case h == nil:
		case l == nil:
			h.OK("No lease held; the next write that needs one grants it")
		default:
			h.OK(fmt.Sprintf("Keeping lease %x alive", int64(l.id)))
		}
	}
	cur := c.currentLease()
	report(cur)
	for {
		var answers <-chan *clientv3.LeaseKeepAliveResponse
		if cur != nil {
			answers = cur.responses
		}
		select {
		case <-ctx.Done():
			// The client is closed: its keepalive streams ended.
			if cur != nil {
				c.leaseLost(cur, "keepalive ended")
			}
			return nil
		case <-c.leaseGranted:
			// A lease is granted only once the previous one is lost,
			// whose keepalive then needs no watching.
			cur = c.currentLease()
			report(cur)
		case _, ok := <-answers:
			if ok {
				continue
			}
			// The channel closes when the lease expired or was revoked
			// (by us or anyone else), when etcd was unreachable for the
			// whole TTL, or when the client closed.
			c.leaseLost(cur, "keepalive ended")
			cur = nil
			report(cur)
		}
	}
}

// reasonRevoked marks a lease this node revoked itself.
const reasonRevoked = "revoked by this node"

// leaseLost ends l's keepalive and, if l is current, forgets it, reports
// the loss and wakes everyone waiting on it.
func (c *Client) leaseLost(l *nodeLease, why string) {
	c.mu.Lock()
	current := c.lease == l
	stopped := c.stopped
	if current {
		c.lease = nil
		c.forgotten = l
		if why != reasonRevoked && !stopped {
			c.lostLease, c.lostWhy = l.id, why
		}
	}
	c.mu.Unlock()
	l.cancel()
	if !current {
		// Whoever forgot it reports the loss and closes l.lost: a
		// second caller (a refused write and the keepalive notice the
		// same loss) that got there first would close it unreported.
		return
	}
	l.lostOnce.Do(func() {
		// Health hears of the loss before anyone waiting on it wakes.
		defer close(l.lost)
		switch {
		case why == reasonRevoked:
			// Asked for by this node (at stop): not a loss to warn of.
			c.log.Debug("Revoked this node's etcd lease", "lease", fmt.Sprintf("%x", int64(l.id)))
		case !stopped:
			c.reportHealth()
			c.log.Warn("Lost this node's etcd lease; its keys are gone and must be written again with a new lease",
				"lease", fmt.Sprintf("%x", int64(l.id)), "reason", why)
		}
	})
}

// LeaseLost returns a channel that is closed once lease id is lost or
// revoked, after health has heard of the loss. It is closed already when id
// is neither the current lease nor the last one lost. After it
// closes, Lease grants a new lease; keys written with the old one are gone.
func (c *Client) LeaseLost(id clientv3.LeaseID) <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.lease != nil && c.lease.id == id {
		return c.lease.lost
	}
	if c.forgotten != nil && c.forgotten.id == id {
		return c.forgotten.lost
	}
	return closedChan
}

var closedChan = func() chan struct{} {
	ch := make(chan struct{})
	close(ch)
	return ch
}()

// RevokeLease revokes the node's lease, deleting every key attached to it
// at once. A later Lease call grants a new one.
func (c *Client) RevokeLease(ctx context.Context) error {
	c.grantMu.Lock()
	defer c.grantMu.Unlock()
	c.mu.Lock()
	cli, l := c.cli, c.lease
	c.mu.Unlock()
	if l == nil || cli == nil {
		return nil
	}
	c.leaseLost(l, reasonRevoked)
	rctx, cancel := c.RequestContext(ctx)
	defer cancel()
	if _, err := cli.Revoke(rctx, l.id); err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound) {
		return fmt.Errorf("kvstore: revoking lease %x: %w", int64(l.id), err)
	}
	return nil
}

// currentLease returns the current lease or nil.
func (c *Client) currentLease() *nodeLease {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lease
}

// RequestCounts returns how many RPCs this client sent, by gRPC method name
// (Range, Txn, Put, DeleteRange, LeaseGrant, Status, ...; streams such as
// Watch and LeaseKeepAlive count once per stream opened). Retries count as
// separate requests: the figure is what etcd served.
func (c *Client) RequestCounts() map[string]uint64 {
	out := map[string]uint64{}
	c.counts.Range(func(k, v any) bool {
		out[k.(string)] = v.(*atomic.Uint64).Load()
		return true
	})
	return out
}

func (c *Client) count(method string) {
	name := method[strings.LastIndexByte(method, '/')+1:]
	v, ok := c.counts.Load(name)
	if !ok {
		v, _ = c.counts.LoadOrStore(name, new(atomic.Uint64))
	}
	v.(*atomic.Uint64).Add(1)
}

// kvMethodPrefix is the gRPC service whose calls the rate limit applies to:
// the reads and writes of data, not lease keepalives or status.
const kvMethodPrefix = "/etcdserverpb.KV/"

// leaseMethodPrefix is the gRPC service of lease grants and revocations.
const leaseMethodPrefix = "/etcdserverpb.Lease/"

func (c *Client) unaryInterceptor(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if c.limiter != nil && strings.HasPrefix(method, kvMethodPrefix) {
		if err := c.limiter.Wait(ctx); err != nil {
			return fmt.Errorf("kvstore: rate limit: %w", err)
		}
	}
	c.count(method)
	start := time.Now()
	err := invoker(ctx, method, req, reply, cc, opts...)
	c.metrics.observe(method, req, err, time.Since(start))
	if err != nil {
		c.noteError(req, err)
	} else if strings.HasPrefix(method, kvMethodPrefix) || strings.HasPrefix(method, leaseMethodPrefix) {
		// A Status answer would prove less: a member answers it without
		// a leader.
		c.lastAnswer.Store(time.Now().UnixNano())
	}
	return err
}

func (c *Client) streamInterceptor(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	c.count(method)
	s, err := streamer(ctx, desc, cc, method, opts...)
	if err != nil {
		c.noteError(nil, err)
	}
	return s, err
}

// noteError records the last error for Status and notices a lost lease as
// soon as a write using it is refused, rather than at the next keepalive,
// which may be minutes away.
func (c *Client) noteError(req any, err error) {
	if errors.Is(err, context.Canceled) {
		return
	}
	c.mu.Lock()
	c.lastErr = err
	c.mu.Unlock()
	if rpctypes.ErrorDesc(err) != rpctypes.ErrorDesc(rpctypes.ErrGRPCLeaseNotFound) {
		return
	}
	if l := c.currentLease(); l != nil && usesLease(req, l.id) {
		c.leaseLost(l, "etcd refused a write with it: lease not found")
	}
}

func usesLease(req any, id clientv3.LeaseID) bool {
	switch r := req.(type) {
	case *pb.PutRequest:
		return r.Lease == int64(id)
	case *pb.TxnRequest:
		for _, ops := range [][]*pb.RequestOp{r.Success, r.Failure} {
			for _, op := range ops {
				if p := op.GetRequestPut(); p != nil && p.Lease == int64(id) {
					return true
				}
				if t := op.GetRequestTxn(); t != nil && usesLease(t, id) {
					return true
				}
			}
		}
	case *pb.LeaseTimeToLiveRequest:
		return r.ID == int64(id)
	case *pb.LeaseKeepAliveRequest:
		return r.ID == int64(id)
	}
	return false
}

// flatError keeps start errors to one readable line (gRPC errors may carry
// newlines) while errors.Is still sees the cause.
type flatError struct{ err error }

func (e flatError) Error() string { return strings.Join(strings.Fields(e.err.Error()), " ") }
func (e flatError) Unwrap() error { return e.err }
