package testenv

import (
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/client-go/rest"

	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/k8stest"
)

// Etcd is a running one-member etcd.
type Etcd struct {
	cluster *etcdtest.Cluster
}

// StartEtcd starts a one-member etcd on a free 127.0.0.1 port, plain HTTP,
// with its data in a temporary directory of the test, and waits until it
// serves. It fails the test on error; the process is killed when the test
// ends. Its fsync is off: a test's etcd need not survive a power cut, and
// the agent's requests are not slowed by the disk.
func StartEtcd(tb testing.TB) *Etcd {
	tb.Helper()
	return &Etcd{cluster: etcdtest.StartSingle(tb, etcdtest.WithUnsafeNoFsync())}
}

// Endpoints returns the etcd's client URLs, as --kvstore-endpoints takes
// them.
func (e *Etcd) Endpoints() []string { return e.cluster.Endpoints() }

// ClientConfig returns a configuration of an etcd client of the
// endpoints.
func (e *Etcd) ClientConfig() clientv3.Config {
	cfg, err := e.cluster.ClientConfig()
	if err != nil {
		// Only a TLS etcd can fail here, and this package starts none.
		panic(err)
	}
	return cfg
}

// Client returns a client of the etcd, closed when the test ends.
func (e *Etcd) Client(tb testing.TB) *clientv3.Client {
	tb.Helper()
	return e.cluster.Client(tb)
}

// Option changes how StartAPIServer starts a server.
type Option func(*options)

type options struct {
	etcd    *Etcd
	noCRDs  bool
	srvArgs []string
}

// WithEtcd makes the API server keep its objects in e, under a key prefix
// of its own, instead of starting an etcd for itself: several servers can
// share one etcd, also with an agent's kvstore, without seeing each
// other's keys.
func WithEtcd(e *Etcd) Option { return func(o *options) { o.etcd = e } }

// WithoutCRDs leaves the CRD store's CRDs out, for a test of an agent
// that registers them itself (crdstore.RegisterCRDs runs at the store's
// start and installs them when they are missing).
func WithoutCRDs() Option { return func(o *options) { o.noCRDs = true } }

// WithServerArgs passes further flags to kube-apiserver, such as
// "--watch-cache=false".
func WithServerArgs(args ...string) Option {
	return func(o *options) { o.srvArgs = append(o.srvArgs, args...) }
}

// APIServer is a running Kubernetes API server (kube-apiserver).
type APIServer struct {
	server *k8stest.Server
	etcd   *Etcd
}

// StartAPIServer starts a Kubernetes API server (kube-apiserver) on a
// free 127.0.0.1 port with certificates of its own, backed by an etcd of
// its own unless WithEtcd is given, installs the CRD store's CRDs
// (crdstore.CRDs) unless WithoutCRDs is given, and returns once the server
// answers /readyz ok and serves the CRDs' objects. It fails the test on
// error; the processes are killed when the test ends.
func StartAPIServer(tb testing.TB, opts ...Option) *APIServer {
	tb.Helper()
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	if o.etcd == nil {
		o.etcd = StartEtcd(tb)
	}
	return startAPIServer(tb, o.etcd, o.noCRDs, k8stest.WithServerArgs(o.srvArgs...))
}

// startAPIServer starts an API server on e, with the CRD store's CRDs
// unless noCRDs.
func startAPIServer(tb testing.TB, e *Etcd, noCRDs bool, opts ...k8stest.Option) *APIServer {
	tb.Helper()
	s := &APIServer{
		server: k8stest.Start(tb, append([]k8stest.Option{k8stest.WithEtcd(e.Endpoints()...)}, opts...)...),
		etcd:   e,
	}
	if !noCRDs {
		k8stest.InstallCRD(tb, s.server.RESTConfig(), crdstore.CRDs()...)
	}
	return s
}

// URL is the server's address, https://127.0.0.1:PORT.
func (s *APIServer) URL() string { return s.server.URL() }

// RESTConfig returns a fresh client configuration of the admin user, with
// QPS and burst high enough that the client never throttles a test.
func (s *APIServer) RESTConfig() *rest.Config { return s.server.RESTConfig() }

// KubeconfigPath is the path of a kubeconfig file (mode 0600, credentials
// embedded) of the admin user, for --k8s-kubeconfig-path.
func (s *APIServer) KubeconfigPath() string { return s.server.Kubeconfig() }

// Etcd returns the etcd the server keeps its objects in.
func (s *APIServer) Etcd() *Etcd { return s.etcd }

// Restart stops the server (SIGTERM) and starts it again on the same port
// with the same certificates and data, returning once it passes /readyz
// again: clients, configurations and kubeconfigs made before stay valid.
// It is for tests of what an agent does while its API server is away.
func (s *APIServer) Restart(tb testing.TB) {
	tb.Helper()
	s.server.Restart(tb)
}
