// Package testenv starts a real etcd and a real Kubernetes API server for
// the tests of an agent that composes identityd's cells, in the spirit of
// controller-runtime's envtest and etcd's integration package: no fakes,
// the same servers identityd's own tests run.
//
// StartEtcd starts a one-member etcd as a process of its own on a free
// 127.0.0.1 port. Give its endpoints to kvstore.Cell
// (--kvstore-endpoints) to run the agent on external etcd, or its
// ClientConfig to a client of your own.
//
// StartAPIServer starts kube-apiserver (k8s.io/kubernetes, built in a
// module of its own whose replace directives never reach your go.mod), the
// API server a cluster runs: the core API (Namespaces, Pods, Nodes,
// ServiceAccounts and their tokens), coordination.k8s.io Leases, RBAC with
// its own authorizer, and CustomResourceDefinitions, on an etcd of its own
// (or the one given with WithEtcd), with the CRDs of the CRD store
// (crdstore.CRDs) installed and served. Give its KubeconfigPath to
// k8sclient.Cell (--k8s-kubeconfig-path) with
// --identity-allocation-mode=crd, or its RESTConfig to a client of your
// own. The kubeconfig and the REST config are its admin user's (a client
// certificate in group system:masters), whom RBAC allows everything. No
// controllers or kubelets run: a test creates the service accounts it
// names, and writes pods' status itself.
//
// # Readiness
//
// identityd's Kubernetes client (k8sclient.Cell) asks the API server's
// /readyz at start until it answers ok, and only then /version, for at
// most --k8s-request-timeout: an API server that is starting, or whose
// etcd is gone, answers some requests before it serves every resource, and
// an agent that went on would fail later and less clearly.
// StartAPIServer returns once the server answers /readyz ok.
//
// # Programs
//
// Start starts the same servers for a program instead of a test (a
// development setup, a tool that runs an agent against them), on the ports
// of its Config or free ones, and returns an error instead of failing a
// test; Servers.Stop ends them.
//
// # Processes
//
// The servers run as processes, built with the go command from
// identityd's module source (the directory `go list -m
// github.com/identityd/identityd` names in the test's working directory:
// the module cache, or a replace target) on first use (the API server in
// a module of its own that identityd's source holds, written out beside
// the cached binaries) and cached under
// the user cache directory (identityd-testbin), keyed by that source and
// the Go toolchain: the first build of the API server is long (it compiles
// the Kubernetes API server libraries), later tests only start the
// processes. Build them ahead, with no deadline, by running
//
//	go run github.com/identityd/identityd/testenv/prebuild
//
// in the module that uses this package. A test that has to build a server
// itself stops the build, and every compiler it started, two minutes
// before the test's deadline (go test's -timeout, default 10m) and fails
// with one line that names that command; what was compiled by then stays
// in the build cache. The environment variables
// IDENTITYD_ETCD_BINARY and IDENTITYD_APISERVER_BINARY name binaries to use
// instead. Every process is killed when the test ends (t.Cleanup, and by
// the kernel if the test binary dies first on Linux); their logs are
// printed through the test's log when the test failed.
package testenv
