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
	return testproc.ModuleBinary(deadline, "kube-apiserver", ServerModule, "IDENTITYD_APISERVER_BINARY")
}

// ServerModule is the directory, relative to the module root, that keeps
// the module of its own whose main package is the API server
// (testproc.ModuleSource): k8s.io/kubernetes needs replace directives for
// its staging modules, which must stay out of this module's go.mod and its
// importers'. Kept as files the go command does not take for a module, it
// ships in identityd's module zip, so that an importer's tests (testenv)
// build it from the module cache.
const ServerModule = "internal/k8stest/kubeapiserver"
