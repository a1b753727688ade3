package main

import (
	"net/http"
	"path"
	"strconv"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/internal/etcdtest"
)

// TestTakenIdentityNotReady runs the agent on an external etcd and gives
// the ID of a label set it uses to another label set, as a GC run and
// another node do after the agent's lease was lost for longer than its
// TTL: other nodes now apply the other label set's policy to the agent's
// users of the ID. /readyz turns 503 naming the ID and both label sets,
// /healthz stays 200 (a restart would not give the ID back), the metric
// counts it; once the other label set's master key is gone the agent
// writes its own again and /readyz is 200 after its next check.
func TestTakenIdentityNotReady(t *testing.T) {
	parallelProcess(t)
	if testing.Short() {
		t.Skip("runs etcd and an agent process")
	}
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := etcd.Client(t)
	a := startHealthAgent(t, "--kvstore-endpoints", strings.Join(etcd.Endpoints(), ","), "--node-name", "victim",
		"--identity-restore-grace-period", "1s", "--kvstore-periodic-sync", "1s")
	a.waitFor("/readyz", http.StatusOK, 60*time.Second)
	sh := a.dial()
	defer sh.Close()
	id := allocate(t, sh, "k8s:app=victim", "k8s:io.kubernetes.pod.namespace=prod")
	mine := "k8s:app=victim;k8s:io.kubernetes.pod.namespace=prod;"
	other := "k8s:app=newcomer;k8s:io.kubernetes.pod.namespace=prod;"
	master := etcdstore.MasterKeyPrefix + strconv.Itoa(id)
	if resp, err := cli.Get(t.Context(), master); err != nil || len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != mine {
		t.Fatalf("master key %s: %v %v", master, resp, err)
	}

	otherRef := path.Join(etcdstore.IdentitiesPrefix, "value", other, "node-b")
	if _, err := cli.Txn(t.Context()).Then(
		clientv3.OpDelete(path.Join(etcdstore.IdentitiesPrefix, "value", mine, "victim")),
		clientv3.OpPut(master, other),
		clientv3.OpPut(otherRef, strconv.Itoa(id)),
	).Commit(); err != nil {
		t.Fatal(err)
	}
	_, body := a.waitFor("/readyz", http.StatusServiceUnavailable, 30*time.Second)
	for _, want := range []string{"level=Degraded", "another label set", strconv.Itoa(id), mine, other} {
		if !strings.Contains(body, want) {
			t.Errorf("/readyz with the ID taken does not say %q:\n%s", want, body)
		}
	}
	if code, body := a.probe("/healthz"); code != http.StatusOK {
		t.Errorf("/healthz %d with the ID taken (liveness must stay):\n%s", code, body)
	}
	if _, body := a.probe("/metrics"); !strings.Contains(body, "identityd_kvstore_identities_taken_total ") ||
		strings.Contains(body, "identityd_kvstore_identities_taken_total 0\n") {
		t.Errorf("/metrics does not count the taken ID:\n%s", body)
	}
	// Checks keep finding it.
	time.Sleep(2 * time.Second)
	if code, _ := a.probe("/readyz"); code != http.StatusServiceUnavailable {
		t.Errorf("/readyz %d after further checks while the ID is still taken", code)
	}

	if _, err := cli.Txn(t.Context()).Then(clientv3.OpDelete(otherRef), clientv3.OpDelete(master)).Commit(); err != nil {
		t.Fatal(err)
	}
	a.waitFor("/readyz", http.StatusOK, 30*time.Second)
	if resp, err := cli.Get(t.Context(), master); err != nil || len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != mine {
		t.Fatalf("master key %s after the other label set's went: %v %v", master, resp, err)
	}
}
