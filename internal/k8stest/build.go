package k8stest

import "github.com/identityd/identityd/internal/testproc"

// Binary returns the path of the API server binary (package
// internal/k8stest/apiserver) built from this module's
// k8s.io/apiextensions-apiserver version, once per version and cached (see
// testproc.Binary). IDENTITYD_APISERVER_BINARY, when set, names the binary to
// use instead. The first build takes minutes.
func Binary() (string, error) {
	return testproc.Binary("apiserver", "internal/k8stest/apiserver", "IDENTITYD_APISERVER_BINARY")
}
