package k8sclient_test

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/k8sclient"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/testhive"
)

// node is one agent's hive running the Kubernetes client cell, with
// health and jobs as in the agent.
type node struct {
	t        testing.TB
	h        *hive.Hive
	client   *k8sclient.Client
	health   *health.Provider
	registry *prometheus.Registry
}

// newNode builds a node in mode (empty: no mode in the hive).
func newNode(t testing.TB, mode identity.AllocationMode, configure func(*k8sclient.Config)) *node {
	n := &node{t: t, registry: prometheus.NewRegistry()}
	cells := []cell.Cell{
		health.Cell,
		job.Cell,
		k8sclient.Cell,
		cell.Invoke(func(c *k8sclient.Client, p *health.Provider) { n.client, n.health = c, p }),
		// The collectors as the metrics cell registers them, without
		// its HTTP server.
		cell.Invoke(func(in struct {
			cell.In
			Collectors []prometheus.Collector `group:"identityd-metrics"`
		}) error {
			for _, c := range in.Collectors {
				if c != nil {
					if err := n.registry.Register(c); err != nil {
						return err
					}
				}
			}
			return nil
		}),
	}
	if mode != "" {
		cells = append(cells, cell.Provide(func() identity.AllocationMode { return mode }))
	}
	opts := hive.DefaultOptions()
	opts.ModuleDecorators = health.ModuleDecorators
	n.h = hive.NewWithOptions(opts, cells...)
	hive.AddConfigOverride(n.h, func(c *k8sclient.Config) {
		c.K8sRequestTimeout = 10 * time.Second
		if configure != nil {
			configure(c)
		}
	})
	return n
}

// start starts the node's hive, which stops when the test ends.
func (n *node) start() error {
	_, err := testhive.TryStart(n.t, n.h, nil)
	return err
}

// noCluster hides a pod's in-cluster settings from the test.
func noCluster(t *testing.T) {
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	t.Setenv("KUBERNETES_SERVICE_PORT", "")
}

// TestProvidedOnlyWhenNeeded: no client in kvstore mode (or without a
// mode) unless a flag names a server; one in crd mode.
func TestProvidedOnlyWhenNeeded(t *testing.T) {
	noCluster(t)
	for _, tt := range []struct {
		name      string
		mode      identity.AllocationMode
		configure func(*k8sclient.Config)
		want      bool
	}{
		{"no mode", "", nil, false},
		{"kvstore mode", identity.AllocationModeKVStore, nil, false},
		{"kvstore mode, qps only", identity.AllocationModeKVStore, func(c *k8sclient.Config) { c.K8sClientQPS = 5 }, false},
		{"crd mode", identity.AllocationModeCRD, nil, true},
		{"kvstore mode, api server", identity.AllocationModeKVStore, func(c *k8sclient.Config) { c.K8sAPIServer = "https://127.0.0.1:1" }, true},
		{"no mode, kubeconfig", "", func(c *k8sclient.Config) { c.K8sKubeconfigPath = "/nonexistent" }, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			n := newNode(t, tt.mode, tt.configure)
			if err := n.h.Populate(hivetest.Logger(t)); err != nil {
				t.Fatal(err)
			}
			if got := n.client != nil; got != tt.want {
				t.Fatalf("client provided: %v, want %v", got, tt.want)
			}
			if !tt.want {
				// Without a client the start reads and dials nothing.
				if err := n.start(); err != nil {
					t.Fatalf("start without a client: %v", err)
				}
			}
		})
	}
}

// TestInvalidFlagsFailEvenWithoutClient: a bad value is an error in
// kvstore mode too.
func TestInvalidFlagsFailEvenWithoutClient(t *testing.T) {
	n := newNode(t, identity.AllocationModeKVStore, func(c *k8sclient.Config) { c.K8sClientQPS = -3 })
	err := n.h.Populate(hivetest.Logger(t))
	if err == nil || !strings.Contains(err.Error(), "--k8s-client-qps -3 must not be negative") {
		t.Fatalf("Populate() = %v, want the qps error", err)
	}
}

// TestStartWithoutServerNamesTheFlags: crd mode outside a pod and without
// flags fails the start with an error naming the flags.
func TestStartWithoutServerNamesTheFlags(t *testing.T) {
	noCluster(t)
	n := newNode(t, identity.AllocationModeCRD, nil)
	err := n.start()
	if !errors.Is(err, k8sclient.ErrNoAPIServer) {
		t.Fatalf("start: %v, want ErrNoAPIServer", err)
	}
	for _, want := range []string{"--k8s-kubeconfig-path", "--k8s-api-server", "KUBERNETES_SERVICE_HOST"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("start error %q does not name %s", err, want)
		}
	}
}

// TestStartUnreadableKubeconfig: a kubeconfig that cannot be read, or that
// is not a kubeconfig, fails the start with an error naming the path.
func TestStartUnreadableKubeconfig(t *testing.T) {
	noCluster(t)
	dir := t.TempDir()
	missing := filepath.Join(dir, "missing.yaml")
	garbage := filepath.Join(dir, "garbage.yaml")
	if err := os.WriteFile(garbage, []byte("{not: [yaml"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{missing, garbage, dir} {
		n := newNode(t, identity.AllocationModeCRD, func(c *k8sclient.Config) { c.K8sKubeconfigPath = path })
		err := n.start()
		if err == nil || !strings.Contains(err.Error(), path) {
			t.Errorf("start with kubeconfig %s: %v, want an error naming the path", path, err)
		} else {
			t.Logf("%s: %v", filepath.Base(path), err)
		}
	}
}

// TestStartRefusedWithinTimeout: nothing listens at the server's address:
// the start fails after --k8s-request-timeout, saying the connection was
// refused.
func TestStartRefusedWithinTimeout(t *testing.T) {
	noCluster(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	n := newNode(t, identity.AllocationModeCRD, func(c *k8sclient.Config) {
		c.K8sAPIServer = "http://" + addr
		c.K8sRequestTimeout = 2 * time.Second
	})
	began := time.Now()
	err = n.start()
	took := time.Since(began)
	if err == nil {
		t.Fatal("start succeeded with nothing listening")
	}
	t.Logf("after %s: %v", took, err)
	for _, want := range []string{addr, "not ready within 2s", "connection refused"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("start error %q does not say %q", err, want)
		}
	}
	// Generous: the bound is 2s plus one retry pause, on a loaded machine.
	if took > 20*time.Second {
		t.Errorf("start took %s, want about 2s", took)
	}
}

// TestStartHungServerWithinTimeout: a server that accepts connections and
// never answers fails the start after --k8s-request-timeout, not never.
func TestStartHungServerWithinTimeout(t *testing.T) {
	noCluster(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var conns sync.WaitGroup
	done := make(chan struct{})
	conns.Go(func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			// Hold the connection open without answering, until the test ends.
			conns.Go(func() { <-done; c.Close() })
		}
	})
	defer func() { l.Close(); close(done); conns.Wait() }()
	n := newNode(t, identity.AllocationModeCRD, func(c *k8sclient.Config) {
		c.K8sAPIServer = "http://" + l.Addr().String()
		c.K8sRequestTimeout = 2 * time.Second
	})
	began := time.Now()
	err = n.start()
	took := time.Since(began)
	if err == nil {
		t.Fatal("start succeeded against a server that never answers")
	}
	t.Logf("after %s: %v", took, err)
	for _, want := range []string{l.Addr().String(), "not ready within 2s", "no answer in time"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("start error %q does not say %q", err, want)
		}
	}
	if took > 20*time.Second {
		t.Errorf("start took %s, want about 2s", took)
	}
}
