package readme

import (
	"context"
	"fmt"
	"log/slog"
	"regexp"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/spf13/pflag"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/cells/restoration"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
	"github.com/identityd/identityd/testenv"
)

// agent is what the test's own cell gets from the composed cells.
type agent struct {
	restorer  *restoration.Restorer
	allocator allocator.Allocator
	flags     *pflag.FlagSet
}

// start composes README.md's hive with a cell of the test's, sets the
// flags (and those every test needs: a state directory of its own, the
// ipcache map in a file, no metrics port), starts it and stops it when the
// test ends.
func start(t *testing.T, flags map[string]string) *agent {
	t.Helper()
	a := &agent{flags: pflag.NewFlagSet("myagent", pflag.ContinueOnError)}
	// The agent's cell depends on the restorer, as README.md says a cell
	// that allocates at start does.
	myAgentCell := cell.Invoke(func(r *restoration.Restorer, alloc allocator.Allocator) {
		a.restorer, a.allocator = r, alloc
	})
	h := newHive(a.flags, myAgentCell)
	all := map[string]string{
		"state-dir":             t.TempDir(),
		"ipcache-map":           "file",
		"prometheus-serve-addr": "",
		"node-name":             "node-a",
	}
	for k, v := range flags {
		all[k] = v
	}
	for k, v := range all {
		if err := a.flags.Set(k, v); err != nil {
			t.Fatalf("--%s=%s: %v", k, v, err)
		}
	}
	log := slog.New(slog.DiscardHandler)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	if err := h.Start(log, ctx); err != nil {
		t.Fatalf("starting README.md's composition: %v", err)
	}
	t.Cleanup(func() {
		if err := h.Stop(log, context.Background()); err != nil {
			t.Errorf("stopping: %v", err)
		}
	})
	return a
}

// helpGracePeriods returns the automatic grace periods the usage of
// --identity-restore-grace-period states: with the embedded etcd, and with
// external kvstore endpoints.
func (a *agent) helpGracePeriods(t *testing.T) (embedded, external time.Duration) {
	t.Helper()
	f := a.flags.Lookup("identity-restore-grace-period")
	if f == nil {
		t.Fatal("no --identity-restore-grace-period")
	}
	m := regexp.MustCompile(`0: (\S+) with the embedded etcd, (\S+) with external kvstore endpoints`).FindStringSubmatch(f.Usage)
	if m == nil {
		t.Fatalf("the usage of --identity-restore-grace-period states no automatic periods: %q", f.Usage)
	}
	var err error
	if embedded, err = time.ParseDuration(m[1]); err != nil {
		t.Fatal(err)
	}
	if external, err = time.ParseDuration(m[2]); err != nil {
		t.Fatal(err)
	}
	return embedded, external
}

// allocateGlobal allocates a global identity once restoration is done.
func (a *agent) allocateGlobal(t *testing.T) *identity.Identity {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	id, _, err := a.allocator.Allocate(ctx, labels.MustParse("k8s:app=web", "k8s:io.kubernetes.pod.namespace=default"))
	if err != nil {
		t.Fatalf("allocating a global identity: %v", err)
	}
	if id.ID.Scope() != identity.ScopeGlobal {
		t.Fatalf("identity %d has scope %s, want global", id.ID, id.ID.Scope())
	}
	return id
}

func TestEmbeddedEtcd(t *testing.T) {
	a := start(t, nil)
	embedded, _ := a.helpGracePeriods(t)
	if got := a.restorer.GracePeriod(); got != embedded || got != 30*time.Second {
		t.Errorf("grace period with the embedded etcd %s, --help states %s (30s)", got, embedded)
	}
	a.allocateGlobal(t)
}

func TestExternalEtcd(t *testing.T) {
	etcd := testenv.StartEtcd(t)
	a := start(t, map[string]string{"kvstore-endpoints": etcd.Endpoints()[0]})
	_, external := a.helpGracePeriods(t)
	if got := a.restorer.GracePeriod(); got != external || got != 10*time.Minute {
		t.Errorf("grace period with external kvstore endpoints %s, --help states %s (10m)", got, external)
	}
	id := a.allocateGlobal(t)
	key := fmt.Sprintf("cilium/state/identities/v1/id/%d", id.ID)
	resp, err := etcd.Client(t).Get(t.Context(), key)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) != 1 {
		t.Fatalf("no key %s in the external etcd", key)
	}
}

func TestCRDMode(t *testing.T) {
	api := testenv.StartAPIServer(t)
	a := start(t, map[string]string{
		"identity-allocation-mode": "crd",
		"k8s-kubeconfig-path":      api.KubeconfigPath(),
	})
	_, external := a.helpGracePeriods(t)
	if got := a.restorer.GracePeriod(); got != external || got != 10*time.Minute {
		t.Errorf("grace period in crd mode %s, want the external one --help states, %s (10m)", got, external)
	}
	id := a.allocateGlobal(t)
	dyn, err := dynamic.NewForConfig(api.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	obj, err := dyn.Resource(crdstore.CiliumIdentityResource).Get(t.Context(), id.ID.String(), metav1.GetOptions{})
	if err != nil {
		t.Fatalf("the CiliumIdentity object of identity %d: %v", id.ID, err)
	}
	if got := obj.GetLabels()["io.kubernetes.pod.namespace"]; got != "default" {
		t.Errorf("CiliumIdentity %s has namespace label %q, want default", obj.GetName(), got)
	}
}
