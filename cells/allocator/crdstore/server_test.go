package crdstore

import (
	"context"
	"net"
	"os"
	"testing"
	"time"

	"k8s.io/apiextensions-apiserver/pkg/cmd/server/options"
	genericapiserver "k8s.io/apiserver/pkg/server"
	"k8s.io/client-go/rest"

	"github.com/identityd/identityd/internal/etcdtest"
)

type tmpServer struct{ cfg *rest.Config }

func (s *tmpServer) RESTConfig() *rest.Config { return rest.CopyConfig(s.cfg) }

// startServer starts an API server with the store's CRDs installed, past
// the server's delay of creates on a just established CRD.
func startServer(tb testing.TB) *tmpServer {
	tb.Helper()
	srv := startBareServer(tb)
	if err := RegisterCRDs(context.Background(), srv.cfg); err != nil {
		tb.Fatal(err)
	}
	time.Sleep(2100 * time.Millisecond)
	return srv
}

// startBareServer starts an API server without CRDs.
func startBareServer(tb testing.TB) *tmpServer {
	tb.Helper()
	etcd := etcdtest.StartSingle(tb, etcdtest.WithUnsafeNoFsync())
	o := options.NewCustomResourceDefinitionsServerOptions(nil, nil)
	o.RecommendedOptions.Authentication.RemoteKubeConfigFileOptional = true
	o.RecommendedOptions.Authorization.RemoteKubeConfigFileOptional = true
	o.RecommendedOptions.Admission = nil
	kc := tb.TempDir() + "/kubeconfig"
	if err := os.WriteFile(kc, []byte("apiVersion: v1\nkind: Config\nclusters: [{name: x, cluster: {server: 'https://127.0.0.1:1'}}]\ncontexts: [{name: x, context: {cluster: x, user: x}}]\nusers: [{name: x, user: {}}]\ncurrent-context: x\n"), 0o600); err != nil {
		tb.Fatal(err)
	}
	o.RecommendedOptions.CoreAPI.CoreAPIKubeconfigPath = kc
	o.RecommendedOptions.Features.EnablePriorityAndFairness = false
	if err := o.ServerRunOptions.ComponentGlobalsRegistry.Set(); err != nil {
		tb.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	o.RecommendedOptions.SecureServing.Listener = ln
	o.RecommendedOptions.SecureServing.BindPort = ln.Addr().(*net.TCPAddr).Port
	o.RecommendedOptions.SecureServing.ServerCert.CertDirectory = tb.TempDir()
	o.RecommendedOptions.SecureServing.ExternalAddress = net.ParseIP("127.0.0.1")
	o.RecommendedOptions.Etcd.StorageConfig.Transport.ServerList = etcd.Endpoints()
	o.RecommendedOptions.Etcd.StorageConfig.Prefix = "/registry"
	if err := o.Complete(); err != nil {
		tb.Fatal(err)
	}
	if err := o.Validate(); err != nil {
		tb.Fatal(err)
	}
	config, err := o.Config()
	if err != nil {
		tb.Fatal(err)
	}
	config.GenericConfig.SharedInformerFactory = nil
	server, err := config.Complete().New(genericapiserver.NewEmptyDelegate())
	if err != nil {
		tb.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		server.GenericAPIServer.PrepareRun().RunWithContext(ctx)
	}()
	tb.Cleanup(func() { cancel(); <-done })
	cfg := rest.CopyConfig(server.GenericAPIServer.LoopbackClientConfig)
	cfg.QPS, cfg.Burst = -1, 0
	rc, err := rest.UnversionedRESTClientFor(&rest.Config{Host: cfg.Host, TLSClientConfig: cfg.TLSClientConfig, BearerToken: cfg.BearerToken,
		APIPath: "/", ContentConfig: rest.ContentConfig{NegotiatedSerializer: newCodecs().WithoutConversion()}})
	if err != nil {
		tb.Fatal(err)
	}
	deadline := time.Now().Add(time.Minute)
	for {
		var code int
		rc.Get().AbsPath("/readyz").Do(ctx).StatusCode(&code)
		if code == 200 {
			break
		}
		if time.Now().After(deadline) {
			tb.Fatal("API server not ready")
		}
		time.Sleep(100 * time.Millisecond)
	}
	return &tmpServer{cfg: cfg}
}
