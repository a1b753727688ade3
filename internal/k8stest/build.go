package k8stest

import (
	"time"

	"github.com/identityd/identityd/internal/testproc"
)

// Binary returns the path of the API server binary (package
// internal/k8stest/apiserver) built from this module's
// k8s.io/apiextensions-apiserver version, once per version and cached (see
// testproc.Binary), with ServerBuildFlags, stopping a build that would end
// after deadline less testproc.DeadlineReserve (zero: none).
// IDENTITYD_APISERVER_BINARY, when set, names the binary to use instead.
// The first build takes minutes.
func Binary(deadline time.Time) (string, error) {
	return testproc.Binary(deadline, "apiserver", ServerPackage, "IDENTITYD_APISERVER_BINARY", ServerBuildFlags...)
}

// ServerPackage is the API server's main package, relative to the module
// root.
const ServerPackage = "internal/k8stest/apiserver"

// ServerBuildFlags are the go build flags of the API server beyond the
// image's mode. They cut the compile of the packages that only the server
// imports, most of a fresh machine's build of it: no DWARF for
// k8s.io/apiserver, which nothing reads (the server is no one's to debug;
// its stack traces come from the symbol table); and neither DWARF nor
// optimization for k8s.io/api and client-go's typed clients, informers,
// listers and apply configurations, large generated code that a server of
// CRDs links through k8s.io/apiserver but hardly runs. Each pattern names
// packages that neither the agent nor the test etcd server imports
// (TestServerBuildFlagsLeaveSharedPackages): a package both import would
// be compiled once more, in this mode as well as theirs.
var ServerBuildFlags = []string{
	"-gcflags=k8s.io/apiserver/...=-dwarf=false",
	"-gcflags=k8s.io/api/...=-N -l -dwarf=false",
	"-gcflags=k8s.io/client-go/informers/...=-N -l -dwarf=false",
	"-gcflags=k8s.io/client-go/kubernetes/...=-N -l -dwarf=false",
	"-gcflags=k8s.io/client-go/listers/...=-N -l -dwarf=false",
	"-gcflags=k8s.io/client-go/applyconfigurations/...=-N -l -dwarf=false",
}
