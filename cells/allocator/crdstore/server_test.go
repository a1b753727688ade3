package crdstore

import (
	"testing"

	"github.com/identityd/identityd/internal/k8stest"
)

// startServer starts an API server (internal/k8stest: a separate process
// on its own etcd) with the store's CRDs installed, past the server's delay
// of creates on a just established CRD.
func startServer(tb testing.TB, opts ...k8stest.Option) *k8stest.Server {
	tb.Helper()
	srv := startBareServer(tb, opts...)
	k8stest.InstallCRD(tb, srv.RESTConfig(), CiliumIdentityCRD(), IdentityNodeCRD(), IdentityLeaseCRD())
	return srv
}

// Tests on a server of their own call t.Parallel: most of their time is
// the server's start and waits on watches. Those that time leases,
// heartbeat marks or elections in seconds, or count requests, run alone.

// startBareServer starts an API server without CRDs.
func startBareServer(tb testing.TB, opts ...k8stest.Option) *k8stest.Server {
	tb.Helper()
	return k8stest.Start(tb, opts...)
}
