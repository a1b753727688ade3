package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/cells/k8sclient"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/cells/restoration"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/k8stest"
	"github.com/identityd/identityd/labels"
)

// runAgentToExit runs the agent as a process that must exit on its own
// within a minute, and returns its output and exit error.
func runAgentToExit(t *testing.T, args ...string) (string, error) {
	t.Helper()
	var out bytes.Buffer
	cmd := agentCmd(t, args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		return out.String(), err
	case <-time.After(time.Minute):
		cmd.Process.Kill()
		<-done
		t.Fatalf("the agent %v still runs after a minute:\n%s", args, out.String())
		return "", nil
	}
}

// TestAllocationModeInvalid: an unknown mode is refused with the valid
// values.
func TestAllocationModeInvalid(t *testing.T) {
	parallelProcess(t)
	out, err := runAgentToExit(t, "--state-dir", t.TempDir(), "--identity-allocation-mode", "etcd", "--log-level", "error")
	if err == nil || !strings.Contains(out, `invalid --identity-allocation-mode "etcd": must be one of "kvstore", "crd", "doublewrite-readkvstore", "doublewrite-readcrd"`) {
		t.Fatalf("--identity-allocation-mode=etcd: %v %q", err, out)
	}
}

// TestAllocationModeCRDAgentHive: the agent's hive in crd mode, on a real
// API server, sends global identities to the CRD store (a CiliumIdentity
// object), has no etcd client (no embedded etcd, no etcd directory), no
// etcd store, and gives restoration the grace period of a shared store.
func TestAllocationModeCRDAgentHive(t *testing.T) {
	parallelProcess(t)
	if testing.Short() {
		t.Skip("runs an API server")
	}
	srv := k8stest.Start(t)
	var (
		alloc    allocator.Allocator
		client   *kvstore.Client
		etcd     *etcdstore.Store
		crd      *crdstore.Store
		restorer *restoration.Restorer
		prov     *health.Provider
		reg      *prometheus.Registry
	)
	h := newHive(
		cell.Invoke(func(a allocator.Allocator, c *kvstore.Client, s *etcdstore.Store, cs *crdstore.Store, r *restoration.Restorer, p *health.Provider, g *prometheus.Registry) {
			alloc, client, etcd, crd, restorer, prov, reg = a, c, s, cs, r, p, g
		}),
	)
	dir := t.TempDir()
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(h, func(c *metrics.Config) { c.PrometheusServeAddr = "" })
	hive.AddConfigOverride(h, func(c *ipcache.Config) { c.IPCacheMap = "file" })
	hive.AddConfigOverride(h, func(c *allocator.Config) { c.IdentityAllocationMode = identity.AllocationModeCRD })
	hive.AddConfigOverride(h, func(c *k8sclient.Config) { c.K8sKubeconfigPath = srv.Kubeconfig() })
	log := hivetest.Logger(t)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	if err := h.Start(log, ctx); err != nil {
		t.Fatal(err)
	}
	defer h.Stop(log, context.Background())

	if client != nil {
		t.Errorf("crd mode without endpoints has an etcd client (%v)", client.Endpoints())
	}
	if etcd != nil {
		t.Error("crd mode built the etcd store")
	}
	for _, sub := range []string{"etcd", "etcd-tls"} {
		if _, err := os.Stat(filepath.Join(dir, sub)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("<state-dir>/%s in crd mode: %v", sub, err)
		}
	}
	id, _, err := alloc.Allocate(ctx, labels.MustParse("k8s:app=web"))
	if err != nil {
		t.Fatal(err)
	}
	if crd == nil {
		t.Fatal("crd mode has no CRD store")
	}
	if got := newAPIObjects(t, srv).identity(int(id.ID)); got["k8s:app"] != "web" {
		t.Fatalf("identity %d is not a CiliumIdentity object: %v", id.ID, got)
	}
	if g := restorer.GracePeriod(); g != restoration.ExternalGracePeriod {
		t.Errorf("automatic grace period in crd mode %s, want the shared store's %s", g, restoration.ExternalGracePeriod)
	}
	// Health says why the kvstore and the etcd store are idle; the
	// metrics have no etcd series.
	messages := map[string]string{}
	for _, st := range prov.All() {
		if st.Name == "kvstore" || st.Name == "etcdstore" {
			messages[st.Name] = st.Message
			if !st.OK() {
				t.Errorf("health of %s in crd mode: %+v", st.Name, st)
			}
		}
	}
	if messages["kvstore"] != "Not used: crd mode without --kvstore-endpoints" ||
		messages["etcdstore"] != "Not used in crd mode: global identities are CiliumIdentity objects" {
		t.Errorf("health messages in crd mode: %q", messages)
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if strings.HasPrefix(f.GetName(), "identityd_kvstore_") {
			t.Errorf("metric %s in crd mode without an etcd client", f.GetName())
		}
	}
}
