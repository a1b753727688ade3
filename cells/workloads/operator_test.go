package workloads

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/allocatortest"
)

// TestOperatorModeAdopts: in operator mode a pod whose identity the
// identity manager has not created creates none and counts no failure; it
// tries again every second and holds the identity, with its IPs in the
// ipcache, once the manager created it. A pod that waits longer than the
// allocation timeout is reported once: an error line, the counter and the
// serving job's health. In agent mode the first pass creates the identity
// (checked: the test fails with adoptOnly off).
func TestOperatorModeAdopts(t *testing.T) {
	store := allocatortest.NewStore(identity.ClusterInfo{Name: "default"})
	n := newNodeWith(t, allocatortest.DriverCell(identity.AllocationModeKVStore, store.NewBackend("n1")))
	n.w.adoptOnly, n.w.createTimeout = true, 10*time.Second
	p := health.NewProvider()
	n.w.health = p.Root()
	n.setNamespace(testNamespace("ns", nil))
	n.setPod(testPod("web", map[string]string{"app": "web"}, "10.0.0.1"))
	if got := store.Len(); got != 0 {
		t.Fatalf("an agent in operator mode created %d identities", got)
	}
	if got := testutil.ToFloat64(n.w.metrics.failures); got != 0 {
		t.Fatalf("a pod waiting for the manager counted %g failures", got)
	}
	if rows := n.w.List(); len(rows) != 1 || rows[0].State != "waiting for the identity manager" {
		t.Fatalf("workloads list: %+v", rows)
	}

	// The manager creates it; the next try, a second later, adopts it.
	manager := store.NewBackend("manager")
	n.w.mu.Lock()
	lbls := n.w.pods["ns/web"].want.labels
	n.w.mu.Unlock()
	id, _, err := manager.Allocate(t.Context(), lbls, func(*globalstore.Reference) {})
	if err != nil {
		t.Fatal(err)
	}
	n.advance(awaitCreation)
	if got := n.identity("ns/web"); got != id {
		t.Fatalf("the pod holds %d, want the manager's %d", got, id)
	}
	n.expectRows("ns/web", id, "10.0.0.1/32")
	if refs := store.Refs(lbls); refs != 2 {
		t.Fatalf("%d nodes hold the pod's identity, want the manager and this node", refs)
	}

	// A pod whose identity never comes is reported once, after the
	// timeout.
	n.setPod(testPod("db", map[string]string{"app": "db"}, "10.0.0.2"))
	for range 9 {
		n.advance(awaitCreation)
	}
	if got := testutil.ToFloat64(n.w.metrics.notCreated); got != 0 {
		t.Fatalf("reported after 9s of a 10s timeout: %g", got)
	}
	for range 5 {
		n.advance(awaitCreation)
	}
	if got := testutil.ToFloat64(n.w.metrics.notCreated); got != 1 {
		t.Fatalf("identityd_workloads_identity_not_created_total %g after the timeout, want 1", got)
	}
	if msg := rootMessage(p); !strings.Contains(msg, "1 wait longer than --identity-allocation-timeout") {
		t.Fatalf("health %q, want the overdue pod counted", msg)
	}
	if got := store.Len(); got != 1 {
		t.Fatalf("%d identities in the store, want the manager's only", got)
	}
}

func rootMessage(p *health.Provider) string {
	for _, st := range p.All() {
		if st.Message != "" {
			return st.Message
		}
	}
	return ""
}
