package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"

	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/internal/k8stest"
	"github.com/identityd/identityd/internal/robustness"
)

// crdAgentArgs are the flags of an agent in crd mode on the API server of
// kubeconfig, named node.
func crdAgentArgs(kubeconfig, node string, extra ...string) []string {
	return append([]string{"--identity-allocation-mode=crd", "--k8s-kubeconfig-path", kubeconfig,
		"--node-name", node}, extra...)
}

// startCRDAgent starts an agent process in crd mode on dir and waits until
// it is ready.
func startCRDAgent(t *testing.T, dir, kubeconfig, node string, extra ...string) *healthAgent {
	t.Helper()
	a := startHealthAgentIn(t, dir, crdAgentArgs(kubeconfig, node, extra...)...)
	a.waitFor("/readyz", http.StatusOK, 90*time.Second)
	return a
}

// stop sends sig to the agent and waits for it to exit.
func (a *healthAgent) stop(sig syscall.Signal) {
	a.t.Helper()
	if err := a.cmd.Process.Signal(sig); err != nil {
		a.t.Fatal(err)
	}
	err := a.cmd.Wait()
	if sig == syscall.SIGTERM && err != nil {
		a.t.Fatalf("agent exited with %v after SIGTERM:\n%s", err, a.log())
	}
}

var idField = regexp.MustCompile(`"id": ([0-9]+)`)

// allocate allocates the label set through the agent's shell and returns
// its numeric identity.
func allocate(t *testing.T, sh *robustness.Shell, lbls ...string) int {
	t.Helper()
	out, err := sh.Run(time.Now().Add(time.Minute), append([]string{"identity/allocate", "-o", "json"}, lbls...)...)
	if err != nil {
		t.Fatalf("identity/allocate %v: %v\n%s", lbls, err, out)
	}
	m := idField.FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("identity/allocate %v: no id in %q", lbls, out)
	}
	id, _ := strconv.Atoi(m[1])
	return id
}

// apiObjects reads the objects of the crd mode as the test's own admin.
type apiObjects struct {
	t   *testing.T
	dyn dynamic.Interface
}

func newAPIObjects(t *testing.T, srv *k8stest.Server) *apiObjects {
	dyn, err := dynamic.NewForConfig(srv.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	return &apiObjects{t: t, dyn: dyn}
}

// identity returns the security-labels of CiliumIdentity id, or nil when
// it does not exist.
func (o *apiObjects) identity(id int) map[string]string {
	o.t.Helper()
	ctx, cancel := context.WithTimeout(o.t.Context(), 30*time.Second)
	defer cancel()
	obj, err := o.dyn.Resource(crdstore.CiliumIdentityResource).Get(ctx, strconv.Itoa(id), metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		o.t.Fatalf("get CiliumIdentity %d: %v", id, err)
	}
	lbls := map[string]string{}
	raw, _ := obj.Object["security-labels"].(map[string]any)
	for k, v := range raw {
		lbls[k], _ = v.(string)
	}
	return lbls
}

// mark returns the heartbeat mark of CiliumIdentity id: "" when it has
// none or does not exist.
func (o *apiObjects) mark(id int) string {
	o.t.Helper()
	ctx, cancel := context.WithTimeout(o.t.Context(), 30*time.Second)
	defer cancel()
	obj, err := o.dyn.Resource(crdstore.CiliumIdentityResource).Get(ctx, strconv.Itoa(id), metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return ""
	}
	if err != nil {
		o.t.Fatalf("get CiliumIdentity %d: %v", id, err)
	}
	return obj.GetAnnotations()[crdstore.HeartbeatAnnotation]
}

// backdateMark writes at as the heartbeat mark of CiliumIdentity id, as a
// collector that marked it then would have left it.
func (o *apiObjects) backdateMark(id int, at time.Time) {
	o.t.Helper()
	ctx, cancel := context.WithTimeout(o.t.Context(), 30*time.Second)
	defer cancel()
	patch := fmt.Appendf(nil, `{"metadata":{"annotations":{%q:%q}}}`, crdstore.HeartbeatAnnotation, at.UTC().Format(time.RFC3339Nano))
	if _, err := o.dyn.Resource(crdstore.CiliumIdentityResource).Patch(ctx, strconv.Itoa(id), types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		o.t.Fatalf("backdating the mark of CiliumIdentity %d: %v", id, err)
	}
}

// nodeIdentities returns the identities IdentityNode node lists, and
// whether it exists.
func (o *apiObjects) nodeIdentities(node string) ([]int, bool) {
	o.t.Helper()
	ctx, cancel := context.WithTimeout(o.t.Context(), 30*time.Second)
	defer cancel()
	obj, err := o.dyn.Resource(crdstore.IdentityNodeResource).Get(ctx, node, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, false
	}
	if err != nil {
		o.t.Fatalf("get IdentityNode %s: %v", node, err)
	}
	spec, _ := obj.Object["spec"].(map[string]any)
	raw, _ := spec["identities"].([]any)
	var ids []int
	for _, v := range raw {
		switch n := v.(type) {
		case int64:
			ids = append(ids, int(n))
		case float64:
			ids = append(ids, int(n))
		}
	}
	return ids, true
}

// waitUntil polls cond every 250ms until it returns nil, failing the test
// with its last error after within.
func waitUntil(t *testing.T, within time.Duration, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s: %v", what, within, err)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// lists reports an error unless node's IdentityNode lists id (want) or does
// not list it (!want).
func (o *apiObjects) lists(node string, id int, want bool) func() error {
	return func() error {
		ids, ok := o.nodeIdentities(node)
		if !ok {
			return fmt.Errorf("no IdentityNode %s", node)
		}
		if slices.Contains(ids, id) != want {
			return fmt.Errorf("IdentityNode %s lists %v", node, ids)
		}
		return nil
	}
}

// TestCRDModeWithoutKubeconfig: in crd mode without --k8s-kubeconfig-path,
// --k8s-api-server or an in-cluster config the agent refuses to start with
// an error naming those flags, and starts no embedded etcd on the way.
func TestCRDModeWithoutKubeconfig(t *testing.T) {
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	t.Setenv("KUBERNETES_SERVICE_PORT", "")
	dir := t.TempDir()
	out, err := runAgentToExit(t, "--state-dir", dir, "--identity-allocation-mode=crd", "--ipcache-map", "file",
		"--prometheus-serve-addr", "", "--log-level", "error")
	if err == nil || !strings.Contains(out, "--k8s-kubeconfig-path") || !strings.Contains(out, "--k8s-api-server") {
		t.Fatalf("crd mode without a kubeconfig: %v, want an error naming --k8s-kubeconfig-path and --k8s-api-server:\n%s", err, out)
	}
	for _, sub := range []string{"etcd", "etcd-tls"} {
		if _, err := os.Stat(filepath.Join(dir, sub)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("<state-dir>/%s after the refused start: %v", sub, err)
		}
	}
}

// TestCRDModeHeartbeatTimeoutTooShort: in crd mode the agent refuses to
// start with a heartbeat timeout too short for the Cilium agents that may
// share the identities, with an error naming the flag, the minimum and the
// way out where no Cilium agent allocates; below the store's own minimum
// that way out is refused too.
func TestCRDModeHeartbeatTimeoutTooShort(t *testing.T) {
	parallelProcess(t)
	dir := t.TempDir()
	kubeconfig := filepath.Join(dir, "kubeconfig")
	kc := "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: \"https://127.0.0.1:1\"}\n" +
		"users:\n- name: u\n  user: {token: t}\ncontexts:\n- name: c\n  context: {cluster: c, user: u}\ncurrent-context: c\n"
	if err := os.WriteFile(kubeconfig, []byte(kc), 0o600); err != nil {
		t.Fatal(err)
	}
	run := func(extra ...string) (string, error) {
		args := append([]string{"--state-dir", t.TempDir(), "--identity-allocation-mode=crd", "--k8s-kubeconfig-path", kubeconfig,
			"--node-name", "node-a", "--ipcache-map", "file", "--prometheus-serve-addr", "", "--log-level", "error"}, extra...)
		return runAgentToExit(t, args...)
	}
	out, err := run("--identity-heartbeat-timeout=5m")
	if err == nil || !strings.Contains(out, "--identity-heartbeat-timeout must be at least 10m0s beside Cilium agents, not 5m0s") ||
		!strings.Contains(out, "--identity-gc-cilium-agents=false") {
		t.Errorf("--identity-heartbeat-timeout=5m: %v, want a refusal naming the flag, 10m0s and --identity-gc-cilium-agents=false:\n%s", err, out)
	}
	out, err = run("--identity-heartbeat-timeout=1m", "--identity-gc-cilium-agents=false")
	if err == nil || !strings.Contains(out, "--identity-heartbeat-timeout must be at least 2m0s in crd mode, not 1m0s") {
		t.Errorf("--identity-heartbeat-timeout=1m without Cilium agents: %v, want a refusal naming 2m0s:\n%s", err, out)
	}
}

// TestCRDModeProcess runs two agent processes in crd mode on one real API
// server: a global identity allocated through the shell of one is a
// CiliumIdentity object, the other node adopts the same ID, each node's
// IdentityNode lists what it uses, a release takes the ID off the node's
// record only. The metrics have the API client's series and no kvstore
// ones; there is no etcd directory. The API server is stopped mid-run:
// /readyz turns 503 naming the Kubernetes client while /healthz stays 200,
// both recover when it returns, and the watches recover (a new identity
// reaches the other node's cache). A restart of the agent (SIGTERM) keeps
// its identities and its IdentityNode record.
func TestCRDModeProcess(t *testing.T) {
	parallelProcess(t)
	if testing.Short() {
		t.Skip("runs an API server and agent processes")
	}
	srv := k8stest.Start(t)
	objs := newAPIObjects(t, srv)
	dirA := filepath.Join(t.TempDir(), "a")
	// Restored identities stay held past the checks after the restart.
	a := startCRDAgent(t, dirA, srv.Kubeconfig(), "node-a", "--identity-restore-grace-period=10m")
	b := startCRDAgent(t, filepath.Join(t.TempDir(), "b"), srv.Kubeconfig(), "node-b", "--identity-restore-grace-period=1s")
	shA, shB := a.dial(), b.dial()
	defer func() { shB.Close() }()

	web := []string{"k8s:app=web", "k8s:io.kubernetes.pod.namespace=prod"}
	id := allocate(t, shA, web...)
	if id < 256 || id > 65535 {
		t.Fatalf("global identity %d outside cluster 0's range", id)
	}
	if got := objs.identity(id); got["k8s:app"] != "web" || got["k8s:io.kubernetes.pod.namespace"] != "prod" || len(got) != 2 {
		t.Fatalf("CiliumIdentity %d has security-labels %v", id, got)
	}
	waitUntil(t, 30*time.Second, "node-a's IdentityNode lists the identity", objs.lists("node-a", id, true))

	if got := allocate(t, shB, web...); got != id {
		t.Fatalf("node-b got %d for the label set node-a holds as %d", got, id)
	}
	waitUntil(t, 30*time.Second, "node-b's IdentityNode lists the identity", objs.lists("node-b", id, true))
	if out, err := shB.Run(time.Now().Add(time.Minute), "identity/release", strconv.Itoa(id)); err != nil {
		t.Fatalf("release on node-b: %v %s", err, out)
	}
	waitUntil(t, 30*time.Second, "node-b's IdentityNode drops the released identity", objs.lists("node-b", id, false))
	if objs.identity(id) == nil {
		t.Fatalf("CiliumIdentity %d gone while node-a uses it", id)
	}

	// The metrics of crd mode.
	code, body := a.probe("/metrics")
	if code != http.StatusOK || !strings.Contains(body, "identityd_k8s_") {
		t.Errorf("/metrics in crd mode (%d) has no identityd_k8s_ series", code)
	}
	for _, line := range strings.Split(body, "\n") {
		if strings.HasPrefix(line, "identityd_kvstore_") {
			t.Errorf("/metrics in crd mode has %s", line)
			break
		}
	}
	for _, sub := range []string{"etcd", "etcd-tls"} {
		if _, err := os.Stat(filepath.Join(dirA, sub)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("<state-dir>/%s in crd mode: %v", sub, err)
		}
	}

	// The API server goes away mid-watch.
	srv.Stop(t)
	down := time.Now()
	_, body = a.waitFor("/readyz", http.StatusServiceUnavailable, 60*time.Second)
	if !strings.Contains(body, "k8s-client") {
		t.Errorf("/readyz with the API server down does not name the Kubernetes client:\n%s", body)
	}
	if code, body := a.probe("/healthz"); code != http.StatusOK {
		t.Errorf("/healthz %d with the API server down (liveness must stay):\n%s", code, body)
	}
	// Long enough away for the watch's retries to back off to many
	// seconds: readiness must not wait for them.
	time.Sleep(20*time.Second - time.Since(down))
	srv.Restart(t)
	back := time.Now()
	a.waitFor("/readyz", http.StatusOK, 90*time.Second)
	if took := time.Since(back); took > 2*time.Second {
		t.Errorf("/readyz turned 200 %s after the API server was back, want within 2s", took.Round(10*time.Millisecond))
	}
	if code, body := a.probe("/healthz"); code != http.StatusOK {
		t.Errorf("/healthz %d after the API server returned:\n%s", code, body)
	}
	after := allocate(t, shA, "k8s:app=after-restart")
	if objs.identity(after) == nil {
		t.Fatalf("CiliumIdentity %d allocated after the API server's restart is not there", after)
	}
	// node-b's cache learns of it from its watch, which resumes after
	// client-go's backoff: at most 30 s, jittered up to twice that, and
	// readiness no longer waits for it.
	waitUntil(t, 2*time.Minute, "node-b's watch delivers an identity created after the API server's restart", func() error {
		out, err := shB.Run(time.Now().Add(30*time.Second), "identity/get", strconv.Itoa(after))
		if err != nil || !strings.Contains(out, "k8s:app=after-restart") {
			return fmt.Errorf("identity/get %d on node-b: %v %s", after, err, out)
		}
		return nil
	})

	// A restart of node-a keeps its identities: the local ones by the
	// checkpoint and restoration, as in kvstore mode; the global ones are
	// objects of the API server, which give the label set its ID again.
	// Its IdentityNode stays through the stop.
	local := allocate(t, shA, "cidr:10.0.0.0/8", "reserved:world")
	shA.Close()
	a.stop(syscall.SIGTERM)
	if _, ok := objs.nodeIdentities("node-a"); !ok {
		t.Fatal("node-a's IdentityNode is gone after SIGTERM")
	}
	a = startCRDAgent(t, dirA, srv.Kubeconfig(), "node-a", "--identity-restore-grace-period=10m")
	shA = a.dial()
	defer shA.Close()
	if out, err := shA.Run(time.Now().Add(30*time.Second), "identity/get", strconv.Itoa(local)); err != nil || !strings.Contains(out, "cidr:10.0.0.0/8") {
		t.Errorf("local identity %d after node-a's restart: %v %s", local, err, out)
	}
	if _, ok := objs.nodeIdentities("node-a"); !ok {
		t.Fatal("node-a's IdentityNode is gone after its restart")
	}
	for _, held := range []int{id, after} {
		out, err := shA.Run(time.Now().Add(30*time.Second), "identity/get", strconv.Itoa(held))
		if err != nil {
			t.Errorf("identity %d after node-a's restart: %v %s", held, err, out)
		}
	}
	if got := allocate(t, shA, web...); got != id {
		t.Errorf("after node-a's restart its label set has ID %d, was %d", got, id)
	}
	waitUntil(t, 30*time.Second, "node-a's IdentityNode lists the identity it uses again after its restart", objs.lists("node-a", id, true))
}
