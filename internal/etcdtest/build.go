package etcdtest

import (
	"time"

	"github.com/identityd/identityd/internal/testproc"
)

// Binary returns the path of the etcd server binary built from this module's
// go.etcd.io/etcd/server/v3 version, once per version and cached (see
// testproc.Binary), stopping a build that would end after deadline less
// testproc.DeadlineReserve (zero: none). IDENTITYD_ETCD_BINARY, when set,
// names the binary to use instead.
func Binary(deadline time.Time) (string, error) {
	return testproc.Binary(deadline, "etcd", ServerPackage, "IDENTITYD_ETCD_BINARY")
}

// ServerPackage is the etcd server's main package, relative to the module
// root.
const ServerPackage = "internal/etcdtest/etcdserver"
