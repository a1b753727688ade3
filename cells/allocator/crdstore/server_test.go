package crdstore

import (
	"flag"
	"runtime"
	"strconv"
	"testing"

	"go.uber.org/goleak"

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
// heartbeat marks or elections in seconds, or count requests, run alone,
// on the server they share one after the other (serialServer).

// serialServer returns the API server that the tests that run alone share
// (k8stest.Shared): it has the store's CRDs and, when a test gets it, no
// object of any CRD. Tests that stop the server, need it without some
// CRD, or call t.Parallel start one of their own.
func serialServer(t *testing.T) *k8stest.Server {
	t.Helper()
	srv := k8stest.Shared(t)
	k8stest.InstallCRD(t, srv.RESTConfig(), CiliumIdentityCRD(), IdentityNodeCRD(), IdentityLeaseCRD())
	return srv
}

// serverParallel is how many parallel tests run at a time unless
// -test.parallel says otherwise: each waits for a server of its own and for
// watches much longer than it computes, so go test's default of one per
// core leaves the cores idle.
const serverParallel = 4

func TestMain(m *testing.M) {
	flag.Parse()
	parallelSet := false
	flag.Visit(func(f *flag.Flag) { parallelSet = parallelSet || f.Name == "test.parallel" })
	if !parallelSet {
		flag.Set("test.parallel", strconv.Itoa(max(serverParallel, runtime.GOMAXPROCS(0))))
	}
	goleak.VerifyTestMain(stopSharedAfter{m})
}

// stopSharedAfter runs the tests and then stops the shared API server, so
// that goleak finds the goroutines of the tests and not those of the server
// they share.
type stopSharedAfter struct{ m *testing.M }

func (s stopSharedAfter) Run() int {
	code := s.m.Run()
	k8stest.StopShared()
	return code
}

// startBareServer starts an API server without CRDs.
func startBareServer(tb testing.TB, opts ...k8stest.Option) *k8stest.Server {
	tb.Helper()
	return k8stest.Start(tb, opts...)
}
