package doublewrite

import (
	"context"
	"log/slog"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"
	clientv3 "go.etcd.io/etcd/client/v3"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/cells/k8sclient"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/eventually"
	"github.com/identityd/identityd/internal/k8stest"
	"github.com/identityd/identityd/labels"
)

// env is a real etcd and a real API server, shared by the nodes of a test.
type env struct {
	etcd *etcdtest.Cluster
	cli  *clientv3.Client
	api  *k8stest.Server
	dyn  dynamic.Interface
}

func newEnv(t *testing.T) *env {
	etcd := etcdtest.StartSingle(t)
	api := k8stest.Start(t)
	return &env{etcd: etcd, cli: etcd.Client(t), api: api, dyn: dynamic.NewForConfigOrDie(api.RESTConfig())}
}

type node struct {
	a    allocator.Allocator
	dw   *Backend
	etcd *etcdstore.Store
	crd  *crdstore.Store
}

// startNode runs a node of the agent's global-identity cells in mode.
func (e *env) startNode(t *testing.T, name string, mode identity.AllocationMode, flags map[string]string) *node {
	t.Helper()
	var n node
	h := hive.New(job.Cell, statedb.Cell, statedir.Cell, kvstore.Cell, k8sclient.Cell,
		allocator.Cell, etcdstore.Cell, crdstore.Cell, Cell,
		cell.Invoke(func(a allocator.Allocator, dw *Backend, es *etcdstore.Store, cs *crdstore.Store) {
			n = node{a: a, dw: dw, etcd: es, crd: cs}
		}))
	fs := pflag.NewFlagSet(name, pflag.ContinueOnError)
	h.RegisterFlags(fs)
	set := map[string]string{
		"state-dir": t.TempDir(), "node-name": name, "identity-allocation-mode": string(mode),
		"kvstore-endpoints": e.etcd.Endpoints()[0], "k8s-kubeconfig-path": e.api.Kubeconfig(),
		"identity-gc-cilium-agents": "false",
	}
	for k, v := range flags {
		set[k] = v
	}
	for k, v := range set {
		if err := fs.Set(k, v); err != nil {
			t.Fatal(k, err)
		}
	}
	log := slog.New(slog.DiscardHandler)
	if err := h.Start(log, t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Stop(log, context.Background()) })
	return &n
}

// masterKey returns the etcd master key's value of id, "" without one.
func (e *env) masterKey(t *testing.T, id identity.NumericIdentity) string {
	t.Helper()
	resp, err := e.cli.Get(t.Context(), etcdstore.MasterKeyPrefix+id.String())
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) == 0 {
		return ""
	}
	return string(resp.Kvs[0].Value)
}

// reference returns the etcd reference key's value of lbls for node.
func (e *env) reference(t *testing.T, lbls labels.Labels, node string) string {
	t.Helper()
	resp, err := e.cli.Get(t.Context(), etcdstore.ReferenceKeyPrefix+lbls.Canonical()+"/"+node)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) == 0 {
		return ""
	}
	return string(resp.Kvs[0].Value)
}

// object returns the CiliumIdentity of id, nil without one.
func (e *env) object(t *testing.T, id identity.NumericIdentity) *unstructured.Unstructured {
	t.Helper()
	obj, err := e.dyn.Resource(crdstore.CiliumIdentityResource).Get(t.Context(), id.String(), metav1.GetOptions{})
	if err != nil {
		return nil
	}
	return obj
}

// objectLabels returns the canonical label set of id's CiliumIdentity.
func (e *env) objectLabels(t *testing.T, id identity.NumericIdentity) string {
	t.Helper()
	obj := e.object(t, id)
	if obj == nil {
		return ""
	}
	sl, _, _ := unstructured.NestedStringMap(obj.Object, "security-labels")
	var strs []string
	for k, v := range sl {
		if v != "" {
			strs = append(strs, k+"="+v)
		} else {
			strs = append(strs, k)
		}
	}
	l, err := labels.Parse(strs...)
	if err != nil {
		t.Fatal(err)
	}
	return l.Canonical()
}

// nodeRecord returns the IDs of node's IdentityNode.
func (e *env) nodeRecord(t *testing.T, node string) []int64 {
	t.Helper()
	obj, err := e.dyn.Resource(crdstore.IdentityNodeResource).Get(t.Context(), node, metav1.GetOptions{})
	if err != nil {
		return nil
	}
	raw, _, _ := unstructured.NestedSlice(obj.Object, "spec", "identities")
	var out []int64
	for _, v := range raw {
		out = append(out, v.(int64))
	}
	return out
}

func (e *env) seedMaster(t *testing.T, id identity.NumericIdentity, lbls labels.Labels) {
	t.Helper()
	if _, err := e.cli.Put(t.Context(), etcdstore.MasterKeyPrefix+id.String(), lbls.Canonical()); err != nil {
		t.Fatal(err)
	}
}

func (e *env) seedObject(t *testing.T, id identity.NumericIdentity, lbls labels.Labels) {
	t.Helper()
	if err := crdstore.RegisterCRDs(t.Context(), e.api.RESTConfig()); err != nil {
		t.Fatal(err)
	}
	// As identityd writes them in a migration (Mirror, identityd migrate):
	// Cilium's format, the k8s labels also as object labels, created under
	// identityd's field manager, which the CRD store ranks as its own.
	sl, ol := map[string]any{}, map[string]any{}
	for _, l := range lbls {
		sl[l.Source+":"+l.Key] = l.Value
		if l.Source == labels.SourceK8s {
			ol[l.Key] = l.Value
		}
	}
	obj := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": crdstore.CiliumGroup + "/" + crdstore.CiliumVersion, "kind": "CiliumIdentity",
		"metadata":        map[string]any{"name": id.String(), "labels": ol},
		"security-labels": sl,
	}}
	if _, err := e.dyn.Resource(crdstore.CiliumIdentityResource).Create(t.Context(), obj, metav1.CreateOptions{FieldManager: "identityd"}); err != nil {
		t.Fatal(err)
	}
}

var doubleWriteModes = []identity.AllocationMode{identity.AllocationModeDoubleWriteReadKVStore, identity.AllocationModeDoubleWriteReadCRD}

// In each double-write mode an allocation writes the same ID and label set
// to both stores, with this node's use in each (its etcd reference key, its
// IdentityNode); a second node in the same mode gets the same ID; a
// release removes the use from both.
func TestAllocationWritesBothStores(t *testing.T) {
	for _, mode := range doubleWriteModes {
		t.Run(string(mode), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			a := e.startNode(t, "node-a", mode, nil)
			b := e.startNode(t, "node-b", mode, nil)
			web := labels.MustParse("k8s:app=web", "k8s:io.kubernetes.pod.namespace=default")
			id, _, err := a.a.Allocate(t.Context(), web)
			if err != nil {
				t.Fatal(err)
			}
			if got := e.masterKey(t, id.ID); got != web.Canonical() {
				t.Errorf("etcd master key of %d = %q, want %q", id.ID, got, web.Canonical())
			}
			if got := e.reference(t, web, "node-a"); got != id.ID.String() {
				t.Errorf("etcd reference of node-a = %q, want %s", got, id.ID)
			}
			if got := e.objectLabels(t, id.ID); got != web.Canonical() {
				t.Errorf("CiliumIdentity %d holds %q, want %q", id.ID, got, web.Canonical())
			}
			eventually.True(t, "node-a's IdentityNode to list the ID", func() bool {
				return slices.Contains(e.nodeRecord(t, "node-a"), int64(id.ID))
			})
			if mode == identity.AllocationModeDoubleWriteReadCRD {
				// The read store placed it: its probe sequence, not
				// etcd's random pick, and the etcd store adopted it.
				if _, ok := a.crd.LookupByID(id.ID); !ok {
					t.Errorf("read store's cache lacks %d", id.ID)
				}
			}
			idB, _, err := b.a.Allocate(t.Context(), web)
			if err != nil {
				t.Fatal(err)
			}
			if idB.ID != id.ID {
				t.Errorf("node-b got %d, node-a %d", idB.ID, id.ID)
			}
			if st := a.dw.WriteStats(); st.Written != 1 || st.Taken != 0 || st.Pending != 0 {
				t.Errorf("node-a write stats %+v, want 1 written", st)
			}
			if _, err := a.a.Release(t.Context(), id); err != nil {
				t.Fatal(err)
			}
			eventually.True(t, "node-a's uses to end in both stores", func() bool {
				return e.reference(t, web, "node-a") == "" && !slices.Contains(e.nodeRecord(t, "node-a"), int64(id.ID))
			})
		})
	}
}

// An ID the write-only store gives to another label set is reported and
// never written over; the allocation succeeds with the read store's ID.
func TestWriteOnlyConflictReported(t *testing.T) {
	for _, mode := range doubleWriteModes {
		t.Run(string(mode), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			web, other := labels.MustParse("k8s:app=web"), labels.MustParse("k8s:app=other")
			const id = identity.NumericIdentity(300)
			// The read store has web at 300, the write-only store other.
			if mode == identity.AllocationModeDoubleWriteReadKVStore {
				e.seedMaster(t, id, web)
				e.seedObject(t, id, other)
			} else {
				e.seedObject(t, id, web)
				e.seedMaster(t, id, other)
			}
			n := e.startNode(t, "node-a", mode, nil)
			got, _, err := n.a.Allocate(t.Context(), web)
			if err != nil {
				t.Fatal(err)
			}
			if got.ID != id {
				t.Fatalf("allocated %d, want the read store's %d", got.ID, id)
			}
			if mode == identity.AllocationModeDoubleWriteReadKVStore {
				if l := e.objectLabels(t, id); l != other.Canonical() {
					t.Errorf("CiliumIdentity %d holds %q after the allocation, want %q untouched", id, l, other.Canonical())
				}
			} else {
				if l := e.masterKey(t, id); l != other.Canonical() {
					t.Errorf("master key %d holds %q after the allocation, want %q untouched", id, l, other.Canonical())
				}
				if r := e.reference(t, web, "node-a"); r != "" {
					t.Errorf("reference key of web written (%q) while its ID is another label set's", r)
				}
			}
			st := n.dw.WriteStats()
			if st.Taken != 1 || st.TakenTotal != 1 || st.Written != 0 {
				t.Errorf("write stats %+v, want 1 taken", st)
			}
			// The retry does not count it again, nor write over it.
			time.Sleep(1500 * time.Millisecond)
			if st := n.dw.WriteStats(); st.TakenTotal != 1 {
				t.Errorf("taken counted %d times, want once", st.TakenTotal)
			}
			if _, err := n.a.Release(t.Context(), got); err != nil {
				t.Fatal(err)
			}
			if st := n.dw.WriteStats(); st.Taken != 0 || st.Pending != 0 {
				t.Errorf("after the release: %+v, want nothing taken or pending", st)
			}
		})
	}
}

// noCollection: the node takes no part in the collector's election.
var noCollection = map[string]string{"identity-gc-interval": "0"}

// The write-only store's collector, on another node, keeps what this node
// mirrored: its use is recorded there as the read store's is. The
// collector runs every second, as its job runs it; an identity nobody
// uses, seeded beside, shows that it ran.
func TestWriteOnlyGCKeepsMirrored(t *testing.T) {
	t.Run("etcd", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		a := e.startNode(t, "node-a", identity.AllocationModeDoubleWriteReadCRD, noCollection)
		e.startNode(t, "collector", identity.AllocationModeKVStore, map[string]string{"identity-gc-interval": "1s"})
		web := labels.MustParse("k8s:app=web")
		unused := labels.MustParse("k8s:app=unused")
		id, _, err := a.a.Allocate(t.Context(), web)
		if err != nil {
			t.Fatal(err)
		}
		e.seedMaster(t, 400, unused)
		eventually.True(t, "the collector to delete the unused master key", func() bool { return e.masterKey(t, 400) == "" })
		if got := e.masterKey(t, id.ID); got != web.Canonical() {
			t.Errorf("GC of etcd deleted the mirrored identity %d (now %q)", id.ID, got)
		}
	})
	t.Run("crd", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		a := e.startNode(t, "node-a", identity.AllocationModeDoubleWriteReadKVStore, noCollection)
		web := labels.MustParse("k8s:app=web")
		id, _, err := a.a.Allocate(t.Context(), web)
		if err != nil {
			t.Fatal(err)
		}
		eventually.True(t, "node-a's IdentityNode to list the ID", func() bool {
			return slices.Contains(e.nodeRecord(t, "node-a"), int64(id.ID))
		})
		const unusedID = 400
		e.seedObject(t, unusedID, labels.MustParse("k8s:app=unused"))
		e.startNode(t, "collector", identity.AllocationModeCRD, map[string]string{"identity-gc-interval": "1s"})
		eventually.True(t, "the collector to mark the unused identity", func() bool {
			obj := e.object(t, unusedID)
			return obj != nil && obj.GetAnnotations()[crdstore.HeartbeatAnnotation] != ""
		})
		if obj := e.object(t, id.ID); obj == nil || obj.GetAnnotations()[crdstore.HeartbeatAnnotation] != "" {
			t.Errorf("mirrored CiliumIdentity %d gone or marked: %v", id.ID, obj)
		}
	})
}

// The comparison counts the IDs in one store only, and reaches 0
// differences once the nodes used the identities through a double-write
// period; the metrics carry it on the reporting node.
func TestConvergence(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var sets []labels.Labels
	for i := range 5 {
		lbls := labels.MustParse("k8s:app=app" + strconv.Itoa(i))
		sets = append(sets, lbls)
		e.seedMaster(t, identity.NumericIdentity(1000+i), lbls)
	}
	e.seedObject(t, 2000, labels.MustParse("k8s:app=crd-only"))
	n := e.startNode(t, "node-a", identity.AllocationModeDoubleWriteReadKVStore, map[string]string{"identity-gc-interval": "0"})
	eventually.True(t, "both caches", func() bool {
		r := n.dw.Compare()
		return r.Synced && r.KVStore == 5 && r.CRD == 1
	})
	n.dw.compareIfCollecting()
	r := n.dw.LastReport()
	if r == nil || r.Count(OnlyKVStore) != 5 || r.Count(OnlyCRD) != 1 || r.Count(Mismatch) != 0 {
		t.Fatalf("report before the double-write period: %+v", r)
	}
	want := map[string]float64{
		"identityd_doublewrite_kvstore_identities": 5, "identityd_doublewrite_crd_identities": 1,
		"identityd_doublewrite_kvstore_only_identities": 5, "identityd_doublewrite_crd_only_identities": 1,
	}
	checkMetrics(t, n.dw, want)

	for _, lbls := range sets {
		if _, _, err := n.a.Allocate(t.Context(), lbls); err != nil {
			t.Fatal(err)
		}
	}
	// The CRD-only identity, used by no one, is gone after its store's
	// collection; here it is deleted as that collection would.
	if err := e.dyn.Resource(crdstore.CiliumIdentityResource).Delete(t.Context(), "2000", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually.True(t, "0 differences", func() bool {
		n.dw.compareIfCollecting()
		r := n.dw.LastReport()
		return r != nil && len(r.Diffs) == 0 && r.KVStore == 5 && r.CRD == 5
	})
	want = map[string]float64{
		"identityd_doublewrite_kvstore_identities": 5, "identityd_doublewrite_crd_identities": 5,
		"identityd_doublewrite_kvstore_only_identities": 0, "identityd_doublewrite_crd_only_identities": 0,
	}
	checkMetrics(t, n.dw, want)
}

func checkMetrics(t *testing.T, b *Backend, want map[string]float64) {
	t.Helper()
	reg := prometheus.NewRegistry()
	reg.MustRegister(newCollector(b))
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			if len(m.GetLabel()) == 0 && m.GetGauge() != nil {
				got[mf.GetName()] = m.GetGauge().GetValue()
			}
		}
	}
	for k, v := range want {
		if g, ok := got[k]; !ok || g != v {
			t.Errorf("%s = %v (present %v), want %v", k, g, ok, v)
		}
	}
}

// Nodes of every mode of the migration path, on one etcd and one API
// server, answer the same ID for label sets that exist before they
// allocate them: what a double-write node allocated is in both stores.
func TestMixedModesAgree(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var sets []labels.Labels
	for i := range 20 {
		sets = append(sets, labels.MustParse("k8s:app=app"+strconv.Itoa(i), "k8s:io.kubernetes.pod.namespace=ns"))
	}
	first := map[identity.AllocationMode]*node{}
	for i, mode := range doubleWriteModes {
		first[mode] = e.startNode(t, "first-"+strconv.Itoa(i), mode, nil)
	}
	want := map[string]identity.NumericIdentity{}
	// Half the sets first come from a node reading etcd, half from one
	// reading the CRDs.
	for i, lbls := range sets {
		n := first[doubleWriteModes[i%2]]
		id, _, err := n.a.Allocate(t.Context(), lbls)
		if err != nil {
			t.Fatal(err)
		}
		want[lbls.Canonical()] = id.ID
	}
	for i, mode := range []identity.AllocationMode{identity.AllocationModeKVStore, identity.AllocationModeDoubleWriteReadKVStore,
		identity.AllocationModeDoubleWriteReadCRD, identity.AllocationModeCRD} {
		n := e.startNode(t, "later-"+strconv.Itoa(i), mode, nil)
		for _, lbls := range sets {
			id, _, err := n.a.Allocate(t.Context(), lbls)
			if err != nil {
				t.Fatal(err)
			}
			if id.ID != want[lbls.Canonical()] {
				t.Errorf("%s node: %s is %d, was %d", mode, lbls.Canonical(), id.ID, want[lbls.Canonical()])
			}
		}
	}
}
