package crdstore

import (
	"testing"

	apitesting "k8s.io/apiextensions-apiserver/pkg/cmd/server/testing"
	"k8s.io/apiserver/pkg/storage/storagebackend"
	"k8s.io/client-go/rest"

	"github.com/identityd/identityd/internal/etcdtest"
)

// gcTestServer is a real API server that serves CRDs, on a real etcd.
type gcTestServer struct{ cfg *rest.Config }

func (s *gcTestServer) RESTConfig() *rest.Config { return rest.CopyConfig(s.cfg) }

// startGCTestServer starts an API server of its own for the test.
func startGCTestServer(tb testing.TB) *gcTestServer {
	tb.Helper()
	etcd := etcdtest.StartSingle(tb)
	sc := storagebackend.NewDefaultConfig("/registry", nil)
	sc.Transport.ServerList = etcd.Endpoints()
	srv, err := apitesting.StartTestServer(tb, apitesting.NewDefaultTestServerOptions(), nil, sc)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(srv.TearDownFn)
	cfg := rest.CopyConfig(srv.ClientConfig)
	cfg.QPS, cfg.Burst = -1, 0
	return &gcTestServer{cfg: cfg}
}
