package main

import (
	"bytes"
	"encoding/json"
	"maps"
	"reflect"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"

	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/k8stest"
	"github.com/identityd/identityd/internal/migrate"
	"github.com/identityd/identityd/labels"
)

// migrateIdentities is the number of etcd identities of the process test.
const migrateIdentities = 2000

// TestMigrateKilledAndRerun: `identityd migrate --from kvstore --to crd`
// killed with SIGKILL after it created part of the objects, then run
// again, leaves the API server as an uninterrupted run leaves another one
// that held the same objects before: the same IDs with the same labels,
// and the same conflicts report.
func TestMigrateKilledAndRerun(t *testing.T) {
	if testing.Short() {
		t.Skip("starts etcd and two API servers")
	}
	parallelProcess(t)
	etcd := etcdtest.StartSingle(t)
	cli := etcd.Client(t)
	// The source, as Cilium and identityd write it: master keys, and a
	// reference key of a node on its lease.
	lease, err := cli.Grant(t.Context(), 600)
	if err != nil {
		t.Fatal(err)
	}
	var ops []clientv3.Op
	for i := range migrateIdentities {
		id := strconv.Itoa(256 + i)
		key := labels.MustParse("k8s:app=app"+strconv.Itoa(i), "k8s:io.kubernetes.pod.namespace=ns"+strconv.Itoa(i%7)).Canonical()
		ops = append(ops, clientv3.OpPut(etcdstore.MasterKeyPrefix+id, key),
			clientv3.OpPut(etcdstore.ReferenceKeyPrefix+key+"/node-1", id, clientv3.WithLease(lease.ID)))
		if len(ops) == 100 {
			if _, err := cli.Txn(t.Context()).Then(ops...).Commit(); err != nil {
				t.Fatal(err)
			}
			ops = ops[:0]
		}
	}

	// Two targets with the same objects: every 100th ID held by another
	// label set.
	whole, cut := k8stest.Start(t), k8stest.Start(t)
	for _, api := range []*k8stest.Server{whole, cut} {
		if err := crdstore.RegisterCRDs(t.Context(), api.RESTConfig()); err != nil {
			t.Fatal(err)
		}
		res := dynamic.NewForConfigOrDie(api.RESTConfig()).Resource(crdstore.CiliumIdentityResource)
		for i := 0; i < migrateIdentities; i += 100 {
			obj := &unstructured.Unstructured{Object: map[string]any{
				"apiVersion": "cilium.io/v2", "kind": "CiliumIdentity",
				"metadata":        map[string]any{"name": strconv.Itoa(256 + i)},
				"security-labels": map[string]any{"k8s:other": strconv.Itoa(i)},
			}}
			if _, err := res.Create(t.Context(), obj, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
	}
	args := func(api *k8stest.Server) []string {
		return []string{"migrate", "--from", "kvstore", "--to", "crd", "-o", "json",
			"--kvstore-endpoints", strings.Join(etcd.Endpoints(), ","), "--k8s-kubeconfig-path", api.Kubeconfig()}
	}
	runToEnd := func(api *k8stest.Server) *migrate.Report {
		t.Helper()
		var out, errOut bytes.Buffer
		cmd := agentCmd(t, args(api)...)
		cmd.Stdout, cmd.Stderr = &out, &errOut
		if err := cmd.Run(); err != nil {
			t.Fatalf("migrate: %v\n%s", err, errOut.String())
		}
		var rep migrate.Report
		if err := json.Unmarshal(out.Bytes(), &rep); err != nil {
			t.Fatalf("report: %v\n%s", err, out.String())
		}
		return &rep
	}
	objects := func(api *k8stest.Server) map[string]any {
		t.Helper()
		l, err := dynamic.NewForConfigOrDie(api.RESTConfig()).Resource(crdstore.CiliumIdentityResource).List(t.Context(), metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		m := map[string]any{}
		for _, o := range l.Items {
			m[o.GetName()] = o.Object["security-labels"]
		}
		return m
	}

	want := runToEnd(whole)

	cmd := agentCmd(t, args(cut)...)
	var errOut bytes.Buffer
	cmd.Stderr = &errOut
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	seeded := migrateIdentities / 100
	deadline := time.Now().Add(2 * time.Minute)
	for n := 0; n < seeded+migrateIdentities/4; n = len(objects(cut)) {
		if time.Now().After(deadline) {
			t.Fatalf("migrate created %d objects in 2m\n%s", n-seeded, errOut.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	err = cmd.Wait()
	if st, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !st.Signaled() {
		t.Fatalf("migrate was not killed before it ended (%v): make the kill earlier", err)
	}
	atKill := len(objects(cut)) - seeded
	if atKill >= migrateIdentities {
		t.Fatalf("the killed run had created all %d objects", atKill)
	}
	t.Logf("killed after %d of %d objects", atKill, migrateIdentities)

	got := runToEnd(cut)
	if !reflect.DeepEqual(got.Conflicts, want.Conflicts) || len(want.Conflicts) != seeded {
		t.Errorf("conflicts after the rerun %+v\nuninterrupted %+v", got.Conflicts, want.Conflicts)
	}
	if g, w := objects(cut), objects(whole); !maps.EqualFunc(g, w, func(a, b any) bool { return reflect.DeepEqual(a, b) }) || len(w) != seeded+migrateIdentities {
		t.Errorf("the rerun's target has %d objects, the uninterrupted run's %d, equal: false", len(g), len(w))
	}
	if len(got.Created)+len(got.Present) != migrateIdentities-seeded || len(got.Present) == 0 {
		t.Errorf("rerun: %d created, %d present, want %d in all, some present", len(got.Created), len(got.Present), migrateIdentities-seeded)
	}
}
