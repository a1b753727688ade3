package main

import (
	"fmt"
	"net/http"
	"path/filepath"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"

	"github.com/identityd/identityd/internal/k8stest"
)

// TestOperatorOverlayRBAC runs deploy/overlays/operator's accounts on a
// kube-apiserver whose RBAC authorizer has the overlay's roles and
// bindings: an identity manager in operator mode (which also collects) as
// identityd-manager, and an agent in operator mode as identityd, whose
// role only reads CiliumIdentity objects. The agent's pods get the
// manager's identities, pods of equal labels share one. Once a label set's
// pods are gone and the manager released it, the collector marks its
// identity; a new pod of that label set waits until the manager takes the
// label set up again (an agent in operator mode takes no marked identity
// and removes no mark), and then gets the same number. The authorizer
// says the agent may not create, patch, update or delete a
// CiliumIdentity, and the audit log shows that the agent sent only reads of
// them and that no request of either account was refused.
func TestOperatorOverlayRBAC(t *testing.T) {
	parallelProcess(t)
	if testing.Short() {
		t.Skip("runs an API server, the manager and an agent")
	}
	ctx := t.Context()
	srv, auditLog := auditedServer(t)
	k8stest.InstallCRD(t, srv.RESTConfig(), findObject[*apiextensionsv1.CustomResourceDefinition](t, buildDeploy(t, "crds"), "CustomResourceDefinition")...)
	accounts := applyDeployRBAC(t, srv, "overlays/operator", nil)
	agentAcc, managerAcc := accounts["agent"], accounts["manager"]

	dyn, err := dynamic.NewForConfig(srv.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	for _, verb := range []string{"create", "patch", "update", "delete"} {
		if err := accessAllowed(t, dyn, agentAcc.user, agentAcc.namespace(), "cilium.io", "ciliumidentities", verb); err == nil {
			t.Errorf("deploy/overlays/operator lets the agents %s CiliumIdentity objects", verb)
		}
	}

	core, err := corev1client.NewForConfig(srv.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := core.Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	objs := newAPIObjects(t, srv)
	manager := startManager(t, filepath.Join(t.TempDir(), "manager"), crdAgentArgs(managerAcc.kubeconfig, "manager-0",
		"--identity-management-mode=operator", "--identity-manager-lease-namespace="+managerAcc.namespace(),
		"--identity-gc-lease-namespace="+managerAcc.namespace(), "--identity-change-grace-period="+workloadsGrace.String(),
		"--identity-node-lease-ttl=25s", "--identity-gc-interval=2s", "--identity-heartbeat-timeout=2m", "--identity-gc-cilium-agents=false",
		"--leader-election-lease-duration=4s", "--leader-election-renew-deadline=3s", "--leader-election-retry-period=500ms")...)
	manager.waitFor("/readyz", http.StatusOK, 90*time.Second)
	agent := startCRDAgent(t, filepath.Join(t.TempDir(), "node-0"), agentAcc.kubeconfig, "node-0",
		"--identity-management-mode=operator", "--identity-gc-interval=0", "--identity-change-grace-period="+workloadsGrace.String())

	var pods []workloadPod
	for i := range 12 {
		pods = append(pods, workloadPod{ns: "shop", name: fmt.Sprintf("p-%d", i), node: "node-0",
			app: fmt.Sprintf("app-%d", i%4), ips: []string{fmt.Sprintf("10.5.0.%d", i+1)}})
	}
	createPods(t, core, pods, func(workloadPod) bool { return false })
	ids := waitPodsReady(t, agent, pods, 90*time.Second)
	expectOneIDPerLabelSet(t, pods, ids)

	// app-0's pods go: the agent and the manager release its identity
	// after the grace period, and the collector marks it.
	gone := ids[pods[0].key()]
	var kept []workloadPod
	for _, p := range pods {
		if p.app != "app-0" {
			kept = append(kept, p)
			continue
		}
		if err := core.Pods(p.ns).Delete(ctx, p.name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
			t.Fatal(err)
		}
	}
	waitUntil(t, 2*time.Minute, "the collector marks app-0's identity", func() error {
		if objs.mark(gone) == "" {
			return fmt.Errorf("CiliumIdentity %d is not marked", gone)
		}
		return nil
	})
	back := workloadPod{ns: "shop", name: "back", node: "node-0", app: "app-0", ips: []string{"10.5.1.1"}}
	createPods(t, core, []workloadPod{back}, func(workloadPod) bool { return false })
	again := waitPodsReady(t, agent, append(kept, back), 90*time.Second)
	if again[back.key()] != gone {
		t.Errorf("the new pod of app-0 got %d, want %d, the label set's identity the manager took up again", again[back.key()], gone)
	}
	if m := objs.mark(gone); m != "" {
		t.Errorf("CiliumIdentity %d of a label set a pod has again still carries the mark %q", gone, m)
	}

	for r := range agentRequests(t, auditLog, agentAcc.user) {
		if r.Group == "cilium.io" && r.Resource == "ciliumidentities" && !slices.Contains([]string{"list", "watch"}, r.Verb) {
			t.Errorf("the agent in operator mode sent %s", r)
		}
	}
	for _, acc := range accounts {
		for r, n := range refusedRequests(t, auditLog, acc.user) {
			t.Errorf("deploy/overlays/operator's roles refused %s to %s %d times", r, acc.user, n)
		}
	}
	if v, ok := manager.metricValue(`identityd_crd_allocations_total{outcome="created"}`); !ok || v != 4 {
		t.Errorf("the manager created %g identities (found %t), want 4", v, ok)
	}
}
