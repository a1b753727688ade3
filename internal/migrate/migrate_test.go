package migrate

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"maps"
	"reflect"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
	clientv3 "go.etcd.io/etcd/client/v3"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"

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

var cluster0 = identity.ClusterInfo{Name: identity.DefaultClusterName}

func canon(t testing.TB, strs ...string) string {
	t.Helper()
	return labels.MustParse(strs...).Canonical()
}

// seedEtcd writes master keys as Cilium and identityd write them, each
// with a reference key of node on a lease. values maps a master key's name
// to its value, written as given (invalid ones included).
func seedEtcd(t testing.TB, cli *clientv3.Client, node string, values map[string]string) {
	t.Helper()
	ctx := t.Context()
	lease, err := cli.Grant(ctx, 600)
	if err != nil {
		t.Fatal(err)
	}
	var ops []clientv3.Op
	for _, name := range slices.Sorted(maps.Keys(values)) {
		ops = append(ops, clientv3.OpPut(etcdstore.MasterKeyPrefix+name, values[name]))
		if _, err := labels.ParseCanonical(values[name]); err == nil && name != "abc" {
			ops = append(ops, clientv3.OpPut(etcdstore.ReferencePrefix(values[name])+node, name, clientv3.WithLease(lease.ID)))
		}
		if len(ops) >= 100 {
			if _, err := cli.Txn(ctx).Then(ops...).Commit(); err != nil {
				t.Fatal(err)
			}
			ops = nil
		}
	}
	if _, err := cli.Txn(ctx).Then(ops...).Commit(); err != nil {
		t.Fatal(err)
	}
}

// etcdMasters returns the master keys: name to value.
func etcdMasters(t testing.TB, cli *clientv3.Client) map[string]string {
	t.Helper()
	resp, err := cli.Get(t.Context(), etcdstore.MasterKeyPrefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]string{}
	for _, kv := range resp.Kvs {
		m[string(kv.Key[len(etcdstore.MasterKeyPrefix):])] = string(kv.Value)
	}
	return m
}

// crdObject is the object the migration creates for id and lbls.
func crdObject(t testing.TB, id identity.NumericIdentity, lbls labels.Labels) *unstructured.Unstructured {
	t.Helper()
	u, err := identityObject(id, lbls)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// seedCRD creates CiliumIdentity objects as the CRD store writes them.
func seedCRD(t testing.TB, cfg *rest.Config, ids map[identity.NumericIdentity]labels.Labels) {
	t.Helper()
	if err := crdstore.RegisterCRDs(t.Context(), cfg); err != nil {
		t.Fatal(err)
	}
	dyn := dynamic.NewForConfigOrDie(cfg)
	for id, lbls := range ids {
		if _, err := dyn.Resource(crdstore.CiliumIdentityResource).Create(t.Context(), crdObject(t, id, lbls), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}

// crdObjects returns the CiliumIdentity objects: name to canonical labels
// (or the raw map of those that do not parse).
func crdObjects(t testing.TB, cfg *rest.Config) map[string]string {
	t.Helper()
	l, err := dynamic.NewForConfigOrDie(cfg).Resource(crdstore.CiliumIdentityResource).List(t.Context(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]string{}
	for i := range l.Items {
		it, _ := readIdentity(&l.Items[i])
		m[l.Items[i].GetName()] = it.key
		if it.err != nil {
			m[l.Items[i].GetName()] = it.raw
		}
	}
	return m
}

// crdVersions returns every object's resourceVersion, to see that nothing
// was written.
func crdVersions(t testing.TB, cfg *rest.Config) map[string]string {
	t.Helper()
	dyn := dynamic.NewForConfigOrDie(cfg)
	m := map[string]string{}
	for _, r := range []string{"ciliumidentities", "identitynodes"} {
		gvr := crdstore.CiliumIdentityResource
		if r == "identitynodes" {
			gvr = crdstore.IdentityNodeResource
		}
		l, err := dyn.Resource(gvr).List(t.Context(), metav1.ListOptions{})
		if err != nil {
			continue // the CRD is not installed
		}
		for _, o := range l.Items {
			m[r+"/"+o.GetName()] = o.GetResourceVersion()
		}
	}
	return m
}

func options(from, to Store, cli *clientv3.Client, cfg *rest.Config) Options {
	return Options{From: from, To: to, Cluster: cluster0, Hold: time.Hour, HoldNode: DefaultHoldNode,
		Etcd: cli, K8s: cfg}
}

func ids(es []Entry) []uint32 {
	var out []uint32
	for _, e := range es {
		out = append(out, e.ID)
	}
	return out
}

// The etcd source's identities are created in the API server with their
// IDs; an ID held there by another label set is a conflict: the label set
// gets a new ID at the first free slot of its probe sequence, or the ID the
// target already gives it; a label set the target holds at another ID is
// not created twice; invalid keys are skipped. A dry run reports the same
// and writes nothing; a second run creates nothing.
func TestKVStoreToCRD(t *testing.T) {
	t.Parallel()
	etcd := etcdtest.StartSingle(t)
	cli := etcd.Client(t)
	api := k8stest.Start(t)
	cfg := api.RESTConfig()

	a, b, c, d, f := canon(t, "k8s:app=a"), canon(t, "k8s:app=b"), canon(t, "k8s:app=c"), canon(t, "k8s:app=d"), canon(t, "k8s:app=f")
	seedEtcd(t, cli, "cilium-node", map[string]string{
		"256": a, "257": b,
		"258":   c,                       // target's 258 holds x: conflict, new ID
		"259":   d,                       // target holds d at 400: elsewhere
		"262":   f,                       // target's 262 holds y, f at 600: conflict, new ID 600
		"263":   "k8s:b=1;k8s:a=2;",      // unsorted: skipped
		"70000": canon(t, "k8s:app=far"), // outside cluster 0's range: skipped
		"abc":   a,                       // not an ID: skipped
	})
	seedCRD(t, cfg, map[identity.NumericIdentity]labels.Labels{
		258: labels.MustParse("k8s:app=x"),
		400: labels.MustParse("k8s:app=d"),
		262: labels.MustParse("k8s:app=y"),
		600: labels.MustParse("k8s:app=f"),
	})
	before, versions := crdObjects(t, cfg), crdVersions(t, cfg)

	// c's new ID is the first slot of its probe sequence not held.
	held := map[identity.NumericIdentity]*item{256: nil, 257: nil, 258: nil, 262: nil, 400: nil, 600: nil}
	newC, _ := walk(c, held, cluster0)
	wantConflicts := []Conflict{
		{ID: 258, Labels: c, TargetLabels: canon(t, "k8s:app=x"), NewID: uint32(newC)},
		{ID: 262, Labels: f, TargetLabels: canon(t, "k8s:app=y"), NewID: 600},
	}

	dry := options(KVStore, CRD, cli, cfg)
	dry.DryRun = true
	rep, err := Run(t.Context(), dry)
	if err != nil {
		t.Fatal(err)
	}
	if got := ids(rep.Created); !slices.Equal(got, []uint32{256, 257}) {
		t.Errorf("dry run: created %v, want [256 257]", got)
	}
	if !reflect.DeepEqual(rep.Conflicts, wantConflicts) || rep.NewIDsCreated != 1 {
		t.Errorf("dry run: conflicts %+v (new %d), want %+v (new 1)", rep.Conflicts, rep.NewIDsCreated, wantConflicts)
	}
	if want := []Elsewhere{{ID: 259, Labels: d, TargetIDs: []uint32{400}}}; !reflect.DeepEqual(rep.Elsewhere, want) {
		t.Errorf("dry run: elsewhere %+v, want %+v", rep.Elsewhere, want)
	}
	if len(rep.Skipped) != 3 || rep.Hold != nil {
		t.Errorf("dry run: skipped %+v, hold %+v; want 3 skipped, no hold", rep.Skipped, rep.Hold)
	}
	if got := crdVersions(t, cfg); !maps.Equal(got, versions) {
		t.Fatalf("dry run wrote: objects %v, before %v", got, versions)
	}

	rep, err = Run(t.Context(), options(KVStore, CRD, cli, cfg))
	if err != nil {
		t.Fatal(err)
	}
	if got := ids(rep.Created); !slices.Equal(got, []uint32{256, 257}) || len(rep.Present) != 0 {
		t.Errorf("created %v, present %v; want [256 257], none", got, rep.Present)
	}
	if !reflect.DeepEqual(rep.Conflicts, wantConflicts) || rep.NewIDsCreated != 1 || len(rep.Elsewhere) != 1 || len(rep.Skipped) != 3 {
		t.Errorf("report %+v", rep)
	}
	want := maps.Clone(before)
	want["256"], want["257"], want[newC.String()] = a, b, c
	if got := crdObjects(t, cfg); !maps.Equal(got, want) {
		t.Errorf("target %v, want %v", got, want)
	}
	// Created with the CRD store's field manager, which the store's rule
	// among a label set's objects reads.
	for _, name := range []string{"256", "257", newC.String()} {
		obj, err := dynamic.NewForConfigOrDie(cfg).Resource(crdstore.CiliumIdentityResource).Get(t.Context(), name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if mf := obj.GetManagedFields(); len(mf) != 1 || mf[0].Manager != crdstore.FieldManager {
			t.Errorf("object %s: managedFields %+v, want one of field manager %q", name, mf, crdstore.FieldManager)
		}
	}
	// The hold: an IdentityNode of the hold's lease lists every migrated
	// label set's ID in the target.
	node, err := dynamic.NewForConfigOrDie(cfg).Resource(crdstore.IdentityNodeResource).Get(t.Context(), DefaultHoldNode, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := json.Marshal(node.Object["spec"])
	var spec crdstore.IdentityNodeSpec
	if err := json.Unmarshal(raw, &spec); err != nil {
		t.Fatal(err)
	}
	wantHeld := []uint32{256, 257, 400, 600, uint32(newC)}
	slices.Sort(wantHeld)
	if !slices.Equal(spec.Identities, wantHeld) || spec.LeaseDurationSeconds != 3600 || spec.Holder == nil {
		t.Errorf("IdentityNode spec %+v, want identities %v, lease 3600, a holder", spec, wantHeld)
	}
	if rep.Hold == nil || rep.Hold.IDs != len(wantHeld) {
		t.Errorf("hold %+v", rep.Hold)
	}

	// Again: nothing to create, the same conflicts.
	rep, err = Run(t.Context(), options(KVStore, CRD, cli, cfg))
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Created) != 0 || !slices.Equal(ids(rep.Present), []uint32{256, 257}) || !reflect.DeepEqual(rep.Conflicts, wantConflicts) || rep.NewIDsCreated != 0 {
		t.Errorf("second run: %+v", rep)
	}
	if got := crdObjects(t, cfg); !maps.Equal(got, want) {
		t.Errorf("second run: target %v, want %v", got, want)
	}
}

// The reverse: CiliumIdentity objects become master keys with the same
// IDs, written only where absent, held by reference keys of the hold's
// node on a lease of the hold's TTL. A dry run writes nothing (the etcd's
// revision does not move).
func TestCRDToKVStore(t *testing.T) {
	t.Parallel()
	etcd := etcdtest.StartSingle(t)
	cli := etcd.Client(t)
	api := k8stest.Start(t)
	cfg := api.RESTConfig()

	a, b, c := canon(t, "k8s:app=a"), canon(t, "k8s:app=b"), canon(t, "k8s:app=c")
	seedCRD(t, cfg, map[identity.NumericIdentity]labels.Labels{
		256: labels.MustParse("k8s:app=a"),
		257: labels.MustParse("k8s:app=b"),
		258: labels.MustParse("k8s:app=c"),
		// Cleaned as Cilium cleans keys, its keys leave their prefix.
		259: labels.MustParse("k8s:x/../../id/5=v"),
	})
	seedEtcd(t, cli, "cilium-node", map[string]string{"257": b, "258": canon(t, "k8s:app=z")})
	rev := func() int64 {
		resp, err := cli.Get(t.Context(), "x")
		if err != nil {
			t.Fatal(err)
		}
		return resp.Header.Revision
	}
	r0 := rev()
	dry := options(CRD, KVStore, cli, cfg)
	dry.DryRun = true
	rep, err := Run(t.Context(), dry)
	if err != nil {
		t.Fatal(err)
	}
	if r := rev(); r != r0 {
		t.Fatalf("dry run moved the etcd's revision from %d to %d", r0, r)
	}
	newC, _ := walk(c, map[identity.NumericIdentity]*item{256: nil, 257: nil, 258: nil}, cluster0)
	wantConflicts := []Conflict{{ID: 258, Labels: c, TargetLabels: canon(t, "k8s:app=z"), NewID: uint32(newC)}}
	check := func(what string, rep *Report, created, present []uint32) {
		t.Helper()
		if !slices.Equal(ids(rep.Created), created) || !slices.Equal(ids(rep.Present), present) ||
			!reflect.DeepEqual(rep.Conflicts, wantConflicts) || len(rep.Skipped) != 1 {
			t.Errorf("%s: %+v", what, rep)
		}
	}
	check("dry run", rep, []uint32{256}, []uint32{257})

	rep, err = Run(t.Context(), options(CRD, KVStore, cli, cfg))
	if err != nil {
		t.Fatal(err)
	}
	check("run", rep, []uint32{256}, []uint32{257})
	want := map[string]string{"256": a, "257": b, "258": canon(t, "k8s:app=z"), newC.String(): c}
	if got := etcdMasters(t, cli); !maps.Equal(got, want) {
		t.Errorf("masters %v, want %v", got, want)
	}
	// Every migrated label set has a reference key of the hold's node on a
	// lease whose TTL is the hold's.
	for id, key := range map[string]string{"256": a, "257": b, newC.String(): c} {
		resp, err := cli.Get(t.Context(), etcdstore.ReferencePrefix(key)+DefaultHoldNode)
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != id || resp.Kvs[0].Lease == 0 {
			t.Fatalf("reference of %s: %v", key, resp.Kvs)
		}
		ttl, err := cli.TimeToLive(t.Context(), clientv3.LeaseID(resp.Kvs[0].Lease))
		if err != nil {
			t.Fatal(err)
		}
		if ttl.GrantedTTL != 3600 {
			t.Errorf("hold lease TTL %d, want 3600", ttl.GrantedTTL)
		}
	}
	rep, err = Run(t.Context(), options(CRD, KVStore, cli, cfg))
	if err != nil {
		t.Fatal(err)
	}
	check("second run", rep, nil, []uint32{256, 257})
	if got := etcdMasters(t, cli); !maps.Equal(got, want) {
		t.Errorf("second run: masters %v, want %v", got, want)
	}
}

// A run stopped after some of its writes, then run again, leaves the target
// as one uninterrupted run leaves a fresh copy of it, with the same
// conflicts report.
func TestInterruptedRunResumes(t *testing.T) {
	t.Parallel()
	api := k8stest.Start(t)
	cfg := api.RESTConfig()
	src := map[identity.NumericIdentity]labels.Labels{}
	for i := range 300 {
		src[identity.NumericIdentity(256+i)] = labels.MustParse("k8s:app=a"+strconv.Itoa(i), "k8s:io.kubernetes.pod.namespace=ns")
	}
	seedCRD(t, cfg, src)
	// Two targets with the same content: IDs 256+k*10 held by other sets.
	taken := map[string]string{}
	for i := 0; i < 300; i += 10 {
		taken[strconv.Itoa(256+i)] = canon(t, "k8s:other="+strconv.Itoa(i))
	}
	runTo := func(cli *clientv3.Client, stopAfter int) (*Report, error) {
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		o := options(CRD, KVStore, cli, cfg)
		n := 0
		o.afterWrite = func() {
			if n++; n == stopAfter {
				cancel()
			}
		}
		return Run(ctx, o)
	}
	whole, cut := etcdtest.StartSingle(t).Client(t), etcdtest.StartSingle(t).Client(t)
	seedEtcd(t, whole, "n", taken)
	seedEtcd(t, cut, "n", taken)

	want, err := runTo(whole, -1)
	if err != nil {
		t.Fatal(err)
	}
	// Stopped in the creates of the same IDs, then in those of the new IDs.
	for _, stopAfter := range []int{100, 185} {
		if _, err := runTo(cut, stopAfter); !errors.Is(err, context.Canceled) {
			t.Fatalf("stopped after %d writes: %v", stopAfter, err)
		}
	}
	got, err := runTo(cut, -1)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got.Conflicts, want.Conflicts) || len(want.Conflicts) != 30 {
		t.Errorf("conflicts after resuming %+v, uninterrupted %+v", got.Conflicts, want.Conflicts)
	}
	if g, w := etcdMasters(t, cut), etcdMasters(t, whole); !maps.Equal(g, w) || len(w) != 330 {
		t.Errorf("resumed target has %d master keys, uninterrupted %d; equal: %v", len(g), len(w), maps.Equal(g, w))
	}
	if len(got.Created)+len(got.Present) != 270 {
		t.Errorf("resumed run: %d created, %d present", len(got.Created), len(got.Present))
	}
}

// The objects the migration creates are those the CRD store creates, and a
// label set's first slot is where the store puts it on an empty server.
func TestObjectsAsCRDStoreWritesThem(t *testing.T) {
	t.Parallel()
	api := k8stest.Start(t)
	var a allocator.Allocator
	h := hive.New(job.Cell, statedb.Cell, k8sclient.Cell, allocator.Cell, crdstore.Cell,
		cell.Provide(func() identity.NodeName { return "ref" }),
		cell.Invoke(func(x allocator.Allocator) { a = x }))
	fs := pflag.NewFlagSet("ref", pflag.ContinueOnError)
	h.RegisterFlags(fs)
	for k, v := range map[string]string{"identity-allocation-mode": "crd", "k8s-kubeconfig-path": api.Kubeconfig()} {
		if err := fs.Set(k, v); err != nil {
			t.Fatal(err)
		}
	}
	log := slog.New(slog.DiscardHandler)
	if err := h.Start(log, t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Stop(log, context.Background()) })

	dyn := dynamic.NewForConfigOrDie(api.RESTConfig())
	for _, set := range [][]string{
		{"k8s:app=web", "k8s:io.kubernetes.pod.namespace=prod"},
		{"k8s:io.cilium.k8s.namespace.labels.team=x", "k8s:app=a"},
		{"k8s:app=a=b", "k8s:bad:key=v", "container:c=d", "unspec:e"},
		{"k8s:v=hello world", "k8s:long=" + string(slices.Repeat([]byte("x"), 64))},
	} {
		lbls := labels.MustParse(set...)
		id, _, err := a.Allocate(t.Context(), lbls)
		if err != nil {
			t.Fatal(err)
		}
		first, _ := walk(lbls.Canonical(), nil, cluster0)
		if id.ID != first {
			t.Errorf("%v: store placed it at %d, the migration's first slot is %d", set, id.ID, first)
		}
		obj, err := dyn.Resource(crdstore.CiliumIdentityResource).Get(t.Context(), id.ID.String(), metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		mine := crdObject(t, id.ID, lbls)
		if !reflect.DeepEqual(obj.GetLabels(), mine.GetLabels()) && !(len(obj.GetLabels()) == 0 && len(mine.GetLabels()) == 0) {
			t.Errorf("%v: metadata.labels %v, the store's %v", set, mine.GetLabels(), obj.GetLabels())
		}
		if !reflect.DeepEqual(obj.Object["security-labels"], mine.Object["security-labels"]) {
			t.Errorf("%v: security-labels %v, the store's %v", set, mine.Object["security-labels"], obj.Object["security-labels"])
		}
	}
}

// startEtcdNode starts an agent's allocator in the kvstore mode on the
// etcd at endpoint, as production wires it.
func startEtcdNode(t *testing.T, endpoint, node string) allocator.Allocator {
	t.Helper()
	var a allocator.Allocator
	h := hive.New(job.Cell, statedb.Cell, statedir.Cell, kvstore.Cell, allocator.Cell, etcdstore.Cell,
		cell.Invoke(func(x allocator.Allocator) { a = x }))
	fs := pflag.NewFlagSet(node, pflag.ContinueOnError)
	h.RegisterFlags(fs)
	for k, v := range map[string]string{"state-dir": t.TempDir(), "node-name": node, "kvstore-endpoints": endpoint} {
		if err := fs.Set(k, v); err != nil {
			t.Fatal(err)
		}
	}
	log := slog.New(slog.DiscardHandler)
	if err := h.Start(log, t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Stop(log, context.Background()) })
	return a
}

// The etcd source's master keys are read as the etcd store reads them: a
// name with a leading zero is the ID it holds for every etcd node (and for
// Cilium's agents, which parse it the same way), so it is migrated with
// that ID; a name that is no global identity is skipped.
func TestMasterKeysReadAsEtcdStore(t *testing.T) {
	t.Parallel()
	etcd := etcdtest.StartSingle(t)
	cli := etcd.Client(t)
	cfg := k8stest.Start(t).RESTConfig()
	a, b := canon(t, "k8s:app=a"), canon(t, "k8s:app=b")
	seedEtcd(t, cli, "cilium-node", map[string]string{"0300": a, "301": b, "5": canon(t, "k8s:app=reserved")})

	node := startEtcdNode(t, etcd.Endpoints()[0], "node-a")
	want := map[identity.NumericIdentity]string{300: a, 301: b}
	eventually.True(t, "the etcd node shows the master keys", func() bool {
		for id, key := range want {
			if got := node.LookupByID(id); got == nil || got.Labels.Canonical() != key {
				return false
			}
		}
		return true
	})

	dry := options(KVStore, CRD, cli, cfg)
	dry.DryRun = true
	rep, err := Run(t.Context(), dry)
	if err != nil {
		t.Fatal(err)
	}
	if got := ids(rep.Created); !slices.Equal(got, []uint32{300, 301}) || rep.Created[0].Labels != a {
		t.Errorf("created %+v, want 300 (%s) and 301", rep.Created, a)
	}
	if len(rep.Skipped) != 1 || rep.Skipped[0].Name != "5" {
		t.Errorf("skipped %+v, want the master key 5", rep.Skipped)
	}
}
