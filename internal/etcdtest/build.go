package etcdtest

import "github.com/identityd/identityd/internal/testproc"

// Binary returns the path of the etcd server binary built from this module's
// go.etcd.io/etcd/server/v3 version, once per version and cached (see
// testproc.Binary). IDENTITYD_ETCD_BINARY, when set, names the binary to use
// instead.
func Binary() (string, error) {
	return testproc.Binary("etcd", ServerPackage, "IDENTITYD_ETCD_BINARY")
}

// ServerPackage is the etcd server's main package, relative to the module
// root.
const ServerPackage = "internal/etcdtest/etcdserver"
