package k8stest

import (
	"time"

	"github.com/identityd/identityd/internal/testproc"
)

// Binary returns the path of the API server binary: kube-apiserver, built
// from the module in ServerModule (k8s.io/kubernetes of the version that
// module requires) once per source and cached (see testproc.ModuleBinary),
// stopping a build that would end after deadline less
// testproc.DeadlineReserve (zero: none). IDENTITYD_APISERVER_BINARY, when
// set, names the binary to use instead. The first build takes minutes.
func Binary(deadline time.Time) (string, error) {
	return testproc.ModuleBinary(deadline, "kube-apiserver", ServerModule, "IDENTITYD_APISERVER_BINARY", ServerBuildFlags...)
}

// ServerBuildFlags are the go build flags of the API server beyond the
// image's mode. They cut its compile, most of what a fresh machine's
// `make test` spends on it, at no cost to other builds: the server's
// module shares no package but the standard library's with the agent or
// the test etcd server (its dependencies are at other versions), and the
// flags name none of the standard library's. No DWARF for the
// Kubernetes packages and none in the link, which nothing reads (the
// server is no one's to debug; its stack traces come from the symbol
// table); and neither DWARF nor optimization for generated code that
// the tests' requests hardly run: the typed clients, informers, listers
// and apply configurations of client-go, and the OpenAPI definitions.
var ServerBuildFlags = []string{
	"-ldflags=-w",
	"-gcflags=k8s.io/...=-dwarf=false",
	"-gcflags=k8s.io/client-go/informers/...=-N -l -dwarf=false",
	"-gcflags=k8s.io/client-go/kubernetes/...=-N -l -dwarf=false",
	"-gcflags=k8s.io/client-go/listers/...=-N -l -dwarf=false",
	"-gcflags=k8s.io/client-go/applyconfigurations/...=-N -l -dwarf=false",
	"-gcflags=k8s.io/kubernetes/pkg/generated/...=-N -l -dwarf=false",
}

// ServerModule is the directory, relative to the module root, that keeps
// the module of its own whose main package is the API server
// (testproc.ModuleSource): k8s.io/kubernetes needs replace directives for
// its staging modules, which must stay out of this module's go.mod and its
// importers'. Kept as files the go command does not take for a module, it
// ships in identityd's module zip, so that an importer's tests (testenv)
// build it from the module cache.
const ServerModule = "internal/k8stest/kubeapiserver"
