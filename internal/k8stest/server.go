package k8stest

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/testproc"
)

// DefaultReadyTimeout bounds how long the API server may take to serve.
const DefaultReadyTimeout = 60 * time.Second

// How many times a start is retried when the picked port was taken by
// someone else between picking and binding.
const startAttempts = 5

// The group the API server's authorizer allows everything: the admin's.
const adminGroup = "system:masters"

var errPortClash = errors.New("port already in use")

// Option changes how a server is started.
type Option func(*options)

type options struct {
	etcd         []string
	extraArgs    []string
	readyTimeout time.Duration
	port         int
}

// WithPort serves on this 127.0.0.1 port instead of a free one. A port in
// use fails the start; it is not retried on another.
func WithPort(port int) Option { return func(o *options) { o.port = port } }

// WithEtcd makes the server use the etcd at endpoints (plain HTTP) instead
// of starting its own. Each server keeps its objects under its own prefix,
// so several servers can share one etcd without seeing each other's.
func WithEtcd(endpoints ...string) Option {
	return func(o *options) { o.etcd = endpoints }
}

// WithServerArgs passes further flags to the API server, such as
// "--watch-cache=false".
func WithServerArgs(args ...string) Option {
	return func(o *options) { o.extraArgs = append(o.extraArgs, args...) }
}

// WithReadyTimeout bounds the wait for the server to serve (default
// DefaultReadyTimeout).
func WithReadyTimeout(d time.Duration) Option {
	return func(o *options) { o.readyTimeout = d }
}

// Server is an API server process.
type Server struct {
	tb      testing.TB
	bin     string
	dir     string
	opts    options
	args    []string // the server's flags but the port
	etcd    []string
	ownEtcd *etcdtest.Cluster
	prefix  string
	certs   *etcdtest.Certs
	// adminPEM is the admin's credentials as RESTConfig gives them.
	adminPEM struct{ ca, cert, key []byte }
	admin    clientCert
	port     int
	url      string
	logPath  string
	kubecfg  string
	userSeq  int
	userMu   sync.Mutex
	readyTLS *tls.Config

	mu   sync.Mutex
	proc *process
}

type clientCert struct{ certFile, keyFile string }

// Start builds the API server (once, see Binary), starts it on a free
// 127.0.0.1 port backed by a one-member etcd of its own (fsync off) unless
// WithEtcd is given, and waits until it is ready. It fails the test on
// error. The processes are killed when the test ends.
func Start(tb testing.TB, opts ...Option) *Server {
	tb.Helper()
	bin, err := Binary(testproc.Deadline(tb))
	if err != nil {
		tb.Fatal(err)
	}
	s := &Server{tb: tb, bin: bin, dir: tb.TempDir()}
	s.opts = options{readyTimeout: DefaultReadyTimeout}
	for _, o := range opts {
		o(&s.opts)
	}
	s.etcd = s.opts.etcd
	if len(s.etcd) == 0 {
		s.ownEtcd = etcdtest.StartSingle(tb, etcdtest.WithUnsafeNoFsync())
		s.etcd = s.ownEtcd.Endpoints()
	}
	token := make([]byte, 8)
	rand.Read(token)
	s.prefix = "/k8stest-" + hex.EncodeToString(token)
	s.logPath = filepath.Join(s.dir, "apiserver.log")
	if err := s.prepareFiles(); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(s.cleanup)

	for attempt := 1; ; attempt++ {
		err = s.startOnFreePort()
		if err == nil {
			break
		}
		s.Kill(tb)
		if !errors.Is(err, errPortClash) || attempt == startAttempts || s.opts.port != 0 {
			tb.Fatalf("k8stest: starting the API server: %v", err)
		}
	}
	s.kubecfg = filepath.Join(s.dir, "admin.kubeconfig")
	if err := s.writeKubeconfig(s.kubecfg, "admin", s.admin); err != nil {
		tb.Fatal(err)
	}
	return s
}

// prepareFiles writes the certificates and the service accounts' signing
// key, kept for the server's life so that a restarted server is trusted by
// the same clients and accepts the tokens it issued before.
func (s *Server) prepareFiles() error {
	certs, err := etcdtest.GenerateCerts(filepath.Join(s.dir, "certs"))
	if err != nil {
		return err
	}
	s.certs = certs
	s.admin = clientCert{filepath.Join(s.dir, "certs", "admin.pem"), filepath.Join(s.dir, "certs", "admin-key.pem")}
	if err := certs.IssueClientCert("admin", []string{adminGroup}, s.admin.certFile, s.admin.keyFile); err != nil {
		return err
	}
	adminTLS, err := tls.LoadX509KeyPair(s.admin.certFile, s.admin.keyFile)
	if err != nil {
		return fmt.Errorf("k8stest: loading admin certificate: %w", err)
	}
	for _, f := range []struct {
		path string
		to   *[]byte
	}{{certs.CAFile, &s.adminPEM.ca}, {s.admin.certFile, &s.adminPEM.cert}, {s.admin.keyFile, &s.adminPEM.key}} {
		if *f.to, err = os.ReadFile(f.path); err != nil {
			return fmt.Errorf("k8stest: %w", err)
		}
	}
	s.readyTLS, err = certs.ClientTLS()
	if err != nil {
		return err
	}
	s.readyTLS.Certificates = []tls.Certificate{adminTLS}

	saKey := filepath.Join(s.dir, "certs", "service-account-key.pem")
	if err := writeSigningKey(saKey); err != nil {
		return err
	}
	s.args = append([]string{
		"--etcd-servers", strings.Join(s.etcd, ","),
		"--etcd-prefix", s.prefix,
		"--bind-address", "127.0.0.1",
		"--tls-cert-file", certs.ServerCertFile,
		"--tls-private-key-file", certs.ServerKeyFile,
		"--client-ca-file", certs.CAFile,
		"--authorization-mode", "RBAC",
		// Service account tokens (TokenRequest) are signed and checked
		// with one key of the server's own.
		"--service-account-issuer", "https://kubernetes.default.svc",
		"--service-account-key-file", saKey,
		"--service-account-signing-key-file", saKey,
		"--service-cluster-ip-range", "10.96.0.0/24",
		// No Service "kubernetes" with this server's address: clients
		// here reach it by URL, and there is no network to route one.
		"--endpoint-reconciler-type", "none",
		"--enable-priority-and-fairness=false",
		// The ServiceAccount admission sets a pod's service account to
		// "default" and refuses the pod until that account exists, which
		// kube-controller-manager would create: tests run no controllers,
		// and create the accounts they name themselves.
		"--disable-admission-plugins", "ServiceAccount",
		// A graceful stop ends open watches at once instead of waiting up to
		// a minute for them, as clients see when a server goes away.
		"--shutdown-watch-termination-grace-period=5s",
		"--profiling=false",
	}, s.opts.extraArgs...)
	return nil
}

// writeSigningKey writes a new ECDSA P-256 private key (mode 0600) to
// path, in PEM: the server signs service account tokens with it (ES256)
// and checks them with its public half.
func writeSigningKey(path string) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("k8stest: generating the service account key: %w", err)
	}
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return fmt.Errorf("k8stest: %w", err)
	}
	b := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})
	if err := os.WriteFile(path, b, 0o600); err != nil {
		return fmt.Errorf("k8stest: writing the service account key: %w", err)
	}
	return nil
}

func (s *Server) startOnFreePort() error {
	s.port = s.opts.port
	if s.port == 0 {
		ports, err := testproc.FreePorts(1)
		if err != nil {
			return err
		}
		s.port = ports[0]
	}
	s.url = "https://127.0.0.1:" + strconv.Itoa(s.port)
	return s.spawnAndWait()
}

func (s *Server) spawnAndWait() error {
	args := append([]string{"--secure-port", strconv.Itoa(s.port)}, s.args...)
	p, err := startProcess(s.bin, args, s.logPath)
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.proc = p
	s.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), s.opts.readyTimeout)
	defer cancel()
	return s.waitReady(ctx, p)
}

// waitReady polls /readyz until it answers 200, the process exits or ctx
// ends.
func (s *Server) waitReady(ctx context.Context, p *process) error {
	cli := &http.Client{
		Transport: &http.Transport{TLSClientConfig: s.readyTLS, DisableKeepAlives: true},
		Timeout:   2 * time.Second,
	}
	var lastErr error
	for {
		select {
		case <-p.done:
			if strings.Contains(testproc.ReadFrom(s.logPath, p.logStart), "address already in use") {
				return fmt.Errorf("port %d: %w", s.port, errPortClash)
			}
			return fmt.Errorf("the API server exited before serving (%v); log:\n%s", p.err, testproc.TailFile(s.logPath, 8<<10))
		default:
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, s.url+"/readyz", nil)
		resp, err := cli.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("/readyz: %s", resp.Status)
		}
		lastErr = err
		select {
		case <-ctx.Done():
			return fmt.Errorf("the API server is not ready: %w (last error: %v); log:\n%s", ctx.Err(), lastErr, testproc.TailFile(s.logPath, 8<<10))
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// URL is the server's address, https://127.0.0.1:PORT.
func (s *Server) URL() string { return s.url }

// Etcd returns the endpoints of the etcd the server stores its objects in.
func (s *Server) Etcd() []string { return append([]string(nil), s.etcd...) }

// EtcdCluster returns the etcd the server started for itself, to restart
// or kill it under the server, or nil if it was given one (WithEtcd).
func (s *Server) EtcdCluster() *etcdtest.Cluster { return s.ownEtcd }

// EtcdPrefix is the key prefix under which the server stores its objects.
func (s *Server) EtcdPrefix() string { return s.prefix }

// LogFile is the path of the server's log.
func (s *Server) LogFile() string { return s.logPath }

// CAFile is the CA certificate that signed the server's certificate.
func (s *Server) CAFile() string { return s.certs.CAFile }

// RESTConfig returns a fresh client configuration for the admin user
// (client certificate, group system:masters), with QPS and burst high
// enough that the client never throttles the server's speed. The
// certificates are in the configuration itself: given as files, client-go
// would watch them for rotation with goroutines that never end.
func (s *Server) RESTConfig() *rest.Config {
	return &rest.Config{
		Host: s.url,
		TLSClientConfig: rest.TLSClientConfig{
			CAData:   s.adminPEM.ca,
			CertData: s.adminPEM.cert,
			KeyData:  s.adminPEM.key,
		},
		QPS:   1e6,
		Burst: 1e6,
	}
}

// Kubeconfig is the path of a kubeconfig file (mode 0600) for the admin
// user.
func (s *Server) Kubeconfig() string { return s.kubecfg }

// UserKubeconfig returns the path of a kubeconfig file (mode 0600) for
// another user, authenticated by a client certificate with the given name
// and groups. Unless groups include system:masters, the server's RBAC
// authorizer allows the user what the cluster's default roles give every
// authenticated user (discovery, the health checks, its own access
// reviews) and what roles bound to the user or its groups grant, and
// forbids every other request (403).
func (s *Server) UserKubeconfig(tb testing.TB, user string, groups ...string) string {
	tb.Helper()
	s.userMu.Lock()
	s.userSeq++
	n := s.userSeq
	s.userMu.Unlock()
	dir := tb.TempDir()
	cert := clientCert{filepath.Join(dir, "user.pem"), filepath.Join(dir, "user-key.pem")}
	if err := s.certs.IssueClientCert(user, groups, cert.certFile, cert.keyFile); err != nil {
		tb.Fatal(err)
	}
	path := filepath.Join(dir, fmt.Sprintf("user-%d.kubeconfig", n))
	if err := s.writeKubeconfig(path, user, cert); err != nil {
		tb.Fatal(err)
	}
	return path
}

// writeKubeconfig writes a self-contained kubeconfig (certificates
// embedded) for the user of cert.
func (s *Server) writeKubeconfig(path, user string, cert clientCert) error {
	ca, err := os.ReadFile(s.certs.CAFile)
	if err != nil {
		return fmt.Errorf("k8stest: reading CA: %w", err)
	}
	crt, err := os.ReadFile(cert.certFile)
	if err != nil {
		return fmt.Errorf("k8stest: reading client certificate: %w", err)
	}
	key, err := os.ReadFile(cert.keyFile)
	if err != nil {
		return fmt.Errorf("k8stest: reading client key: %w", err)
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["k8stest"] = &clientcmdapi.Cluster{Server: s.url, CertificateAuthorityData: ca}
	cfg.AuthInfos[user] = &clientcmdapi.AuthInfo{ClientCertificateData: crt, ClientKeyData: key}
	cfg.Contexts["k8stest"] = &clientcmdapi.Context{Cluster: "k8stest", AuthInfo: user}
	cfg.CurrentContext = "k8stest"
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		return fmt.Errorf("k8stest: writing kubeconfig: %w", err)
	}
	// The file holds a private key.
	return os.Chmod(path, 0o600)
}

// Running reports whether the server's process is alive.
func (s *Server) Running() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.proc != nil && !s.proc.exited()
}

// Stop terminates the server gracefully (SIGTERM, SIGKILL after 30s) and
// waits for it to be gone.
func (s *Server) Stop(tb testing.TB) {
	tb.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc != nil {
		s.proc.stop(30 * time.Second)
	}
}

// Kill sends SIGKILL and waits for the process to be gone.
func (s *Server) Kill(tb testing.TB) {
	tb.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc != nil {
		s.proc.kill()
	}
}

// Restart stops the server if it runs and starts it again on the same port
// with the same certificates and etcd prefix, waiting until it is ready:
// clients, configurations and kubeconfigs made before stay valid.
func (s *Server) Restart(tb testing.TB) {
	tb.Helper()
	s.Stop(tb)
	var err error
	for range startAttempts {
		err = s.spawnAndWait()
		if !errors.Is(err, errPortClash) {
			break
		}
		// The port is ours again once its current holder lets go.
		time.Sleep(500 * time.Millisecond)
	}
	if err != nil {
		s.Kill(tb)
		tb.Fatalf("k8stest: restarting the API server: %v", err)
	}
}

func (s *Server) cleanup() {
	s.Kill(s.tb)
	if s.tb.Failed() {
		s.tb.Logf("k8stest: log of the API server (%s):\n%s", s.url, testproc.TailFile(s.logPath, 32<<10))
	}
}

// process is one run of the server binary.
type process struct {
	cmd      *exec.Cmd
	done     chan struct{}
	err      error // written before done is closed
	logStart int64 // where this run's output begins in the log
}

func startProcess(bin string, args []string, logPath string) (*process, error) {
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("k8stest: opening log: %w", err)
	}
	defer logf.Close()
	p := &process{done: make(chan struct{})}
	if fi, err := logf.Stat(); err == nil {
		p.logStart = fi.Size()
	}
	fmt.Fprintf(logf, "=== k8stest: starting the API server at %s\n", time.Now().Format(time.RFC3339Nano))
	p.cmd = exec.Command(bin, args...)
	p.cmd.Stdout, p.cmd.Stderr = logf, logf
	testproc.SetDeathSignal(p.cmd)
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("k8stest: starting the API server: %w", err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

func (p *process) kill() {
	if !p.exited() {
		p.cmd.Process.Signal(syscall.SIGKILL)
		<-p.done
	}
}

func (p *process) stop(grace time.Duration) {
	if p.exited() {
		return
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
		p.kill()
	}
}
