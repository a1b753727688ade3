package etcdtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/identityd/identityd/internal/testproc"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// DefaultReadyTimeout bounds how long a member may take to serve clients.
const DefaultReadyTimeout = 60 * time.Second

// How many times a start is retried when a picked port was taken by someone
// else between picking and binding.
const startAttempts = 5

var errPortClash = errors.New("port already in use")

// Option changes how a cluster is started.
type Option func(*options)

type options struct {
	tls          bool
	certs        *Certs
	noFsync      bool
	logLevel     string
	readyTimeout time.Duration
	extraArgs    []string
	ports        []int // client and peer port of each member; none: free ones
}

// WithPorts puts the members on these 127.0.0.1 ports instead of free
// ones: the client port and the peer port of each member, in order. A
// port in use fails the start; it is not retried on others.
func WithPorts(ports ...int) Option { return func(o *options) { o.ports = ports } }

// WithTLS serves clients over TLS and requires client certificates signed
// by the CA of certs. With nil certs, a fresh set is generated in the
// cluster's directory (see Cluster.Certs).
func WithTLS(certs *Certs) Option {
	return func(o *options) { o.tls, o.certs = true, certs }
}

// WithUnsafeNoFsync turns off fsync in the servers: faster, for tests that
// do not measure or test durability.
func WithUnsafeNoFsync() Option { return func(o *options) { o.noFsync = true } }

// WithServerArgs passes further flags to every member, such as
// "--max-txn-ops=8".
func WithServerArgs(args ...string) Option {
	return func(o *options) { o.extraArgs = append(o.extraArgs, args...) }
}

// WithLogLevel sets the servers' log level (default "warn").
func WithLogLevel(level string) Option { return func(o *options) { o.logLevel = level } }

// WithReadyTimeout bounds the wait for members to serve (default
// DefaultReadyTimeout).
func WithReadyTimeout(d time.Duration) Option { return func(o *options) { o.readyTimeout = d } }

// Cluster is a set of etcd server processes forming one etcd cluster.
type Cluster struct {
	tb      testing.TB
	bin     string
	dir     string
	opts    options
	members []*Member

	mu       sync.Mutex
	username string
	password string
}

// Member is one etcd server process of a cluster.
type Member struct {
	c       *Cluster
	name    string
	dataDir string
	logPath string
	args    []string

	clientURL string
	peerURL   string

	mu     sync.Mutex
	cmd    *exec.Cmd
	done   chan struct{}
	exit   *error // written by the waiter before done is closed
	paused bool
	// release lets go of the member's ports, held while its process is
	// down (see holdPorts).
	release func()
	// logStart is where the current process's output begins in the log,
	// so that a failure is diagnosed from this run's lines only.
	logStart int64
}

// StartSingle starts a one-member cluster and waits until it serves.
func StartSingle(tb testing.TB, opts ...Option) *Cluster {
	tb.Helper()
	return StartCluster(tb, 1, opts...)
}

// StartCluster starts an n-member cluster and waits until every member
// serves and knows the leader. It fails the test on error. The processes are
// killed when the test ends.
func StartCluster(tb testing.TB, n int, opts ...Option) *Cluster {
	tb.Helper()
	if n < 1 {
		tb.Fatalf("etcdtest: cluster size %d < 1", n)
	}
	bin, err := Binary(testproc.Deadline(tb))
	if err != nil {
		tb.Fatal(err)
	}
	c := &Cluster{tb: tb, bin: bin, dir: tb.TempDir()}
	c.opts = options{logLevel: "warn", readyTimeout: DefaultReadyTimeout}
	for _, o := range opts {
		o(&c.opts)
	}
	if c.opts.ports != nil && len(c.opts.ports) != 2*n {
		tb.Fatalf("etcdtest: %d ports for %d members, want a client and a peer port each", len(c.opts.ports), n)
	}
	if c.opts.tls && c.opts.certs == nil {
		certs, err := GenerateCerts(filepath.Join(c.dir, "certs"))
		if err != nil {
			tb.Fatal(err)
		}
		c.opts.certs = certs
	}
	tb.Cleanup(c.cleanup)

	for attempt := 1; ; attempt++ {
		err = c.start(n, attempt)
		if err == nil {
			return c
		}
		c.killAll()
		if !errors.Is(err, errPortClash) || attempt == startAttempts || c.opts.ports != nil {
			tb.Fatalf("etcdtest: starting %d-member cluster: %v", n, err)
		}
	}
}

func (c *Cluster) start(n, attempt int) error {
	ports := c.opts.ports
	if ports == nil {
		var err error
		if ports, err = testproc.FreePorts(2 * n); err != nil {
			return err
		}
	}
	scheme := "http"
	if c.opts.tls {
		scheme = "https"
	}
	token := make([]byte, 8)
	rand.Read(token)

	c.members = make([]*Member, n)
	initial := make([]string, n)
	for i := range n {
		m := &Member{
			c:         c,
			name:      "m" + strconv.Itoa(i),
			clientURL: fmt.Sprintf("%s://127.0.0.1:%d", scheme, ports[2*i]),
			peerURL:   fmt.Sprintf("http://127.0.0.1:%d", ports[2*i+1]),
		}
		m.dataDir = filepath.Join(c.dir, fmt.Sprintf("%s-%d.etcd", m.name, attempt))
		m.logPath = filepath.Join(c.dir, m.name+".log")
		initial[i] = m.name + "=" + m.peerURL
		c.members[i] = m
	}
	for _, m := range c.members {
		m.args = []string{
			"--name", m.name,
			"--data-dir", m.dataDir,
			"--listen-client-urls", m.clientURL,
			"--advertise-client-urls", m.clientURL,
			"--listen-peer-urls", m.peerURL,
			"--initial-advertise-peer-urls", m.peerURL,
			"--initial-cluster", strings.Join(initial, ","),
			"--initial-cluster-state", "new",
			"--initial-cluster-token", "etcdtest-" + hex.EncodeToString(token),
			"--log-outputs", "stderr",
			"--log-level", c.opts.logLevel,
		}
		if c.opts.noFsync {
			m.args = append(m.args, "--unsafe-no-fsync")
		}
		m.args = append(m.args, c.opts.extraArgs...)
		if c.opts.tls {
			m.args = append(m.args,
				"--cert-file", c.opts.certs.ServerCertFile,
				"--key-file", c.opts.certs.ServerKeyFile,
				"--trusted-ca-file", c.opts.certs.CAFile,
				"--client-cert-auth")
		}
		if err := m.spawn(); err != nil {
			return err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), c.opts.readyTimeout)
	defer cancel()
	for _, m := range c.members {
		if err := m.waitReady(ctx, true); err != nil {
			return err
		}
	}
	return nil
}

// Endpoints returns the client URLs of all members.
func (c *Cluster) Endpoints() []string {
	eps := make([]string, len(c.members))
	for i, m := range c.members {
		eps[i] = m.clientURL
	}
	return eps
}

// Member returns the i-th member.
func (c *Cluster) Member(i int) *Member { return c.members[i] }

// Members returns all members.
func (c *Cluster) Members() []*Member { return c.members }

// Dir is the cluster's directory: data directories, logs, certificates.
func (c *Cluster) Dir() string { return c.dir }

// Certs returns the certificates of a TLS cluster, or nil.
func (c *Cluster) Certs() *Certs { return c.opts.certs }

// ClientConfig returns a client configuration for all members, with the
// client certificate of a TLS cluster and the root credentials once
// EnableAuth was called.
func (c *Cluster) ClientConfig() (clientv3.Config, error) {
	cfg := clientv3.Config{
		Endpoints:   c.Endpoints(),
		DialTimeout: 5 * time.Second,
		Logger:      zap.NewNop(),
	}
	if c.opts.tls {
		tlsCfg, err := c.opts.certs.ClientTLS()
		if err != nil {
			return cfg, err
		}
		cfg.TLS = tlsCfg
	}
	c.mu.Lock()
	cfg.Username, cfg.Password = c.username, c.password
	c.mu.Unlock()
	return cfg, nil
}

// Client returns a client of the cluster (see ClientConfig), closed when
// the test ends.
func (c *Cluster) Client(tb testing.TB) *clientv3.Client {
	tb.Helper()
	cfg, err := c.ClientConfig()
	if err != nil {
		tb.Fatal(err)
	}
	cli, err := clientv3.New(cfg)
	if err != nil {
		tb.Fatalf("etcdtest: creating client: %v", err)
	}
	tb.Cleanup(func() { cli.Close() })
	return cli
}

// EnableAuth creates the root user with password and turns authentication
// on; clients from ClientConfig and Client use these credentials afterwards.
func (c *Cluster) EnableAuth(tb testing.TB, password string) {
	tb.Helper()
	cli := c.Client(tb)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := EnableAuth(ctx, cli, password); err != nil {
		tb.Fatal(err)
	}
	c.mu.Lock()
	c.username, c.password = "root", password
	c.mu.Unlock()
}

// EnableAuth creates the user "root" with the root role and password, and
// enables authentication, through cli.
func EnableAuth(ctx context.Context, cli *clientv3.Client, password string) error {
	if _, err := cli.RoleAdd(ctx, "root"); err != nil && !strings.Contains(err.Error(), "already exists") {
		return fmt.Errorf("etcdtest: adding role root: %w", err)
	}
	if _, err := cli.UserAdd(ctx, "root", password); err != nil {
		return fmt.Errorf("etcdtest: adding user root: %w", err)
	}
	if _, err := cli.UserGrantRole(ctx, "root", "root"); err != nil {
		return fmt.Errorf("etcdtest: granting role root: %w", err)
	}
	if _, err := cli.AuthEnable(ctx); err != nil {
		return fmt.Errorf("etcdtest: enabling auth: %w", err)
	}
	return nil
}

// WaitLeader waits until every running member serves and knows a leader,
// e.g. after members were killed and restarted.
func (c *Cluster) WaitLeader(tb testing.TB) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), c.opts.readyTimeout)
	defer cancel()
	for _, m := range c.members {
		if !m.Running() {
			continue
		}
		if err := m.waitReady(ctx, true); err != nil {
			tb.Fatal(err)
		}
	}
}

// Leader returns the index of the member that is the leader, waiting for
// one to be elected.
func (c *Cluster) Leader(tb testing.TB) int {
	tb.Helper()
	cli := c.Client(tb)
	ctx, cancel := context.WithTimeout(context.Background(), c.opts.readyTimeout)
	defer cancel()
	for {
		for i, m := range c.members {
			if !m.Running() {
				continue
			}
			sctx, scancel := context.WithTimeout(ctx, time.Second)
			resp, err := cli.Status(sctx, m.clientURL)
			scancel()
			if err == nil && resp.Leader != 0 && resp.Leader == resp.Header.GetMemberId() {
				return i
			}
		}
		select {
		case <-ctx.Done():
			tb.Fatalf("etcdtest: no leader: %v", ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (c *Cluster) killAll() {
	for _, m := range c.members {
		m.Kill()
		m.mu.Lock()
		m.releasePorts()
		m.mu.Unlock()
	}
}

func (c *Cluster) cleanup() {
	c.killAll()
	if !c.tb.Failed() {
		return
	}
	for _, m := range c.members {
		c.tb.Logf("etcdtest: log of member %s (%s):\n%s", m.name, m.clientURL, testproc.TailFile(m.logPath, 32<<10))
	}
}

// Name is the member's etcd name.
func (m *Member) Name() string { return m.name }

// Endpoint is the member's client URL.
func (m *Member) Endpoint() string { return m.clientURL }

// DataDir is the member's data directory.
func (m *Member) DataDir() string { return m.dataDir }

// LogFile is the path of the member's log.
func (m *Member) LogFile() string { return m.logPath }

// PID returns the process ID, or 0 when the member is not running.
func (m *Member) PID() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cmd == nil || m.exited() {
		return 0
	}
	return m.cmd.Process.Pid
}

// Running reports whether the member's process is alive (also when paused).
func (m *Member) Running() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.cmd != nil && !m.exited()
}

// Kill sends SIGKILL and waits for the process to be gone.
func (m *Member) Kill() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cmd == nil || m.exited() {
		return
	}
	m.cmd.Process.Signal(syscall.SIGKILL)
	<-m.done
	m.paused = false
	m.holdPorts()
}

// Stop terminates the process gracefully (SIGTERM, SIGKILL after 10s) and
// waits for it to be gone.
func (m *Member) Stop() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cmd == nil || m.exited() {
		return
	}
	if m.paused {
		m.cmd.Process.Signal(syscall.SIGCONT)
		m.paused = false
	}
	m.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-m.done:
	case <-time.After(10 * time.Second):
		m.cmd.Process.Signal(syscall.SIGKILL)
		<-m.done
	}
	m.holdPorts()
}

// holdPorts keeps the member's ports from other servers while its process
// is down (see testproc.HoldPorts): a client of this member would otherwise
// reach that server, which answers. Called with m.mu held.
func (m *Member) holdPorts() {
	if m.release != nil {
		return
	}
	var ports []int
	for _, u := range []string{m.clientURL, m.peerURL} {
		if p, err := urlPort(u); err == nil {
			ports = append(ports, p)
		}
	}
	m.release = testproc.HoldPorts(ports...)
}

// releasePorts lets go of what holdPorts holds. Called with m.mu held.
func (m *Member) releasePorts() {
	if m.release != nil {
		m.release()
		m.release = nil
	}
}

func urlPort(u string) (int, error) {
	parsed, err := url.Parse(u)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(parsed.Port())
}

// Pause freezes the process (SIGSTOP): it keeps its sockets but answers
// nothing, like a hung or partitioned server.
func (m *Member) Pause() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cmd != nil && !m.exited() {
		m.cmd.Process.Signal(syscall.SIGSTOP)
		testproc.WaitStopped(m.cmd.Process.Pid)
		m.paused = true
	}
}

// Resume continues a paused process (SIGCONT).
func (m *Member) Resume() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cmd != nil && !m.exited() {
		m.cmd.Process.Signal(syscall.SIGCONT)
		m.paused = false
	}
}

// Restart stops the member if it runs and starts it again on the same data
// directory and ports, waiting until it serves clients. It does not wait for
// a leader, which needs a quorum: use Cluster.WaitLeader for that.
func (m *Member) Restart() {
	m.c.tb.Helper()
	m.Stop()
	var err error
	for range startAttempts {
		if err = m.spawn(); err != nil {
			break
		}
		ctx, cancel := context.WithTimeout(context.Background(), m.c.opts.readyTimeout)
		err = m.waitReady(ctx, false)
		cancel()
		if !errors.Is(err, errPortClash) {
			break
		}
		// The port is ours again once its current holder lets go.
		time.Sleep(500 * time.Millisecond)
	}
	if err != nil {
		m.Kill()
		m.c.tb.Fatalf("etcdtest: restarting member %s: %v", m.name, err)
	}
}

func (m *Member) spawn() error {
	logf, err := os.OpenFile(m.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("opening log of %s: %w", m.name, err)
	}
	defer logf.Close()
	var logStart int64
	if fi, err := logf.Stat(); err == nil {
		logStart = fi.Size()
	}
	fmt.Fprintf(logf, "=== etcdtest: starting %s at %s\n", m.name, time.Now().Format(time.RFC3339Nano))
	cmd := exec.Command(m.c.bin, m.args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	testproc.SetDeathSignal(cmd)
	m.mu.Lock()
	m.releasePorts()
	m.mu.Unlock()
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", m.name, err)
	}
	done := make(chan struct{})
	exit := new(error)
	m.mu.Lock()
	m.cmd, m.done, m.exit, m.paused, m.logStart = cmd, done, exit, false, logStart
	m.mu.Unlock()
	go func() {
		*exit = cmd.Wait()
		close(done)
	}()
	return nil
}

// exited reports whether the process has ended; m.mu is held.
func (m *Member) exited() bool {
	select {
	case <-m.done:
		return true
	default:
		return false
	}
}

// waitReady polls the member until it answers a status request (and, with
// needLeader, knows a leader), the process exits or ctx ends.
func (m *Member) waitReady(ctx context.Context, needLeader bool) error {
	cfg, err := m.c.ClientConfig()
	if err != nil {
		return err
	}
	cfg.Endpoints = []string{m.clientURL}
	cfg.DialTimeout = time.Second
	// With auth, creating a client already needs the server (for the
	// token), so it is retried like the status request.
	var cli *clientv3.Client
	defer func() {
		if cli != nil {
			cli.Close()
		}
	}()

	m.mu.Lock()
	done, exit, logStart := m.done, m.exit, m.logStart
	m.mu.Unlock()
	var lastErr error
	for {
		select {
		case <-done:
			if strings.Contains(testproc.ReadFrom(m.logPath, logStart), "address already in use") {
				return fmt.Errorf("member %s: %w", m.name, errPortClash)
			}
			return fmt.Errorf("member %s exited before serving (%v); log:\n%s", m.name, *exit, testproc.TailFile(m.logPath, 4<<10))
		default:
		}
		if cli == nil {
			cli, err = clientv3.New(cfg)
		}
		if cli != nil {
			sctx, cancel := context.WithTimeout(ctx, time.Second)
			var resp *clientv3.StatusResponse
			resp, err = cli.Status(sctx, m.clientURL)
			cancel()
			if err == nil && (!needLeader || resp.Leader != 0) {
				return nil
			}
			if err == nil {
				err = errors.New("no leader")
			}
		}
		lastErr = err
		select {
		case <-ctx.Done():
			return fmt.Errorf("member %s not ready: %w (last error: %v)", m.name, ctx.Err(), lastErr)
		case <-time.After(50 * time.Millisecond):
		}
	}
}
