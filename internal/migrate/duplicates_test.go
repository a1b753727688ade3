package migrate

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
	clientv3 "go.etcd.io/etcd/client/v3"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/cells/k8sclient"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/idprobe"
	"github.com/identityd/identityd/internal/k8stest"
	"github.com/identityd/identityd/labels"
)

// startCRDNode starts an agent's allocator in the crd mode on api, as
// production wires it.
func startCRDNode(t *testing.T, api *k8stest.Server, node string) allocator.Allocator {
	t.Helper()
	var a allocator.Allocator
	h := hive.New(job.Cell, statedb.Cell, k8sclient.Cell, allocator.Cell, crdstore.Cell,
		cell.Provide(func() identity.NodeName { return identity.NodeName(node) }),
		cell.Invoke(func(x allocator.Allocator) { a = x }))
	fs := pflag.NewFlagSet(node, pflag.ContinueOnError)
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
	return a
}

// dupObject is one object of a label set: at position pos of its probe
// sequence, created by identityd's field manager or another writer's,
// stamped created.
type dupObject struct {
	pos       uint64
	identityd bool
	created   time.Time
}

// createStamped creates the CiliumIdentity of id for lbls with the field
// manager manager, then sets its creationTimestamp to at in the API
// server's etcd: the server stamps a create with its own clock.
func createStamped(t *testing.T, api *k8stest.Server, dyn dynamic.Interface, id identity.NumericIdentity, lbls labels.Labels, manager string, at time.Time) {
	t.Helper()
	ctx := t.Context()
	if _, err := dyn.Resource(crdstore.CiliumIdentityResource).Create(ctx, crdObject(t, id, lbls), metav1.CreateOptions{FieldManager: manager}); err != nil {
		t.Fatalf("creating %d: %v", id, err)
	}
	etcd := api.EtcdCluster().Client(t)
	key := api.EtcdPrefix() + "/" + crdstore.CiliumGroup + "/ciliumidentities/" + id.String()
	got, err := etcd.Get(ctx, key)
	if err != nil || len(got.Kvs) != 1 {
		t.Fatalf("reading %s from the API server's etcd: %v (%d keys)", key, err, len(got.Kvs))
	}
	var obj map[string]any
	if err := json.Unmarshal(got.Kvs[0].Value, &obj); err != nil {
		t.Fatalf("%s does not hold JSON: %v", key, err)
	}
	meta, _ := obj["metadata"].(map[string]any)
	if meta == nil || meta["creationTimestamp"] == nil {
		t.Fatalf("%s has no metadata.creationTimestamp: %s", key, got.Kvs[0].Value)
	}
	meta["creationTimestamp"] = at.UTC().Format(time.RFC3339)
	val, err := json.Marshal(obj)
	if err != nil {
		t.Fatal(err)
	}
	res, err := etcd.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(key), "=", got.Kvs[0].ModRevision)).
		Then(clientv3.OpPut(key, string(val))).Commit()
	if err != nil || !res.Succeeded {
		t.Fatalf("writing %s: %v (succeeded %v)", key, err, res != nil && res.Succeeded)
	}
}

// TestDuplicatesChoiceAsCRDStore: the CRD target holds label sets at
// several IDs (objects of identityd and of Cilium's agents, on and off
// the sets' probe sequences, of several creation seconds), and the etcd
// source holds each set at an ID the target gives another set: a
// conflict, whose new ID is the one the target has for the set. The
// migration plan must report, for every set, the ID a CRD store node
// answers for it on the same objects, which is the rule's pick.
func TestDuplicatesChoiceAsCRDStore(t *testing.T) {
	t.Parallel()
	etcd := etcdtest.StartSingle(t)
	cli := etcd.Client(t)
	api := k8stest.Start(t)
	cfg := api.RESTConfig()
	if err := crdstore.RegisterCRDs(t.Context(), cfg); err != nil {
		t.Fatal(err)
	}
	dyn := dynamic.NewForConfigOrDie(cfg)
	// Old enough that no object created from now on can rank before
	// them: a node answers from its cache, creating nothing.
	old := time.Now().Add(-2 * time.Hour).Truncate(time.Second)
	sec := func(n int) time.Time { return old.Add(time.Duration(n) * time.Second) }

	// The sequence goes up the range from a place of the label set's own
	// and wraps at its end: a set whose sequence wraps between positions
	// 100 and 2000 has there two objects whose IDs are in the opposite
	// order of their positions.
	tie := func() (labels.Labels, uint64, uint64) {
		for n := range 10000 {
			l := labels.MustParse(fmt.Sprintf("k8s:app=tie-%d", n))
			if pr := idprobe.New(l.Canonical(), cluster0); pr.Slot(100) > pr.Slot(2000) {
				return l, 100, 2000
			}
		}
		t.Fatal("no label set whose probe sequence wraps between positions 100 and 2000")
		return nil, 0, 0
	}
	tieSet, p, q := tie()

	cases := []struct {
		name string
		lbls labels.Labels
		objs []dupObject
		want int // index in objs of the object the rule picks
	}{{
		// A Cilium agent's object off the sequence, older than the walk's
		// first object by more than the head start.
		name: "older off the sequence",
		lbls: labels.MustParse("k8s:app=older"),
		objs: []dupObject{{pos: 0, created: sec(60)}, {pos: 1000, created: sec(0)}},
		want: 1,
	}, {
		// identityd's object off the sequence (at etcd's ID, say), younger
		// than a Cilium agent's by less than the head start.
		name: "identityd's head start",
		lbls: labels.MustParse("k8s:app=headstart"),
		objs: []dupObject{{pos: 1000, created: sec(0)}, {pos: 2000, identityd: true, created: sec(20)}},
		want: 1,
	}, {
		// Two Cilium agents' objects of one second: the one earlier on
		// the sequence, whose ID is the larger.
		name: "same second",
		lbls: tieSet,
		objs: []dupObject{{pos: q, created: sec(5)}, {pos: p, created: sec(5)}},
		want: 1,
	}, {
		// The walk's first object is the oldest as well.
		name: "oldest on the sequence",
		lbls: labels.MustParse("k8s:app=first"),
		objs: []dupObject{{pos: 0, created: sec(0)}, {pos: 1500, identityd: true, created: sec(10)}},
		want: 0,
	}}

	used := map[identity.NumericIdentity]string{}
	take := func(id identity.NumericIdentity, what string) {
		if prev, ok := used[id]; ok {
			t.Fatalf("ID %d of %s is that of %s: choose other positions", id, what, prev)
		}
		used[id] = what
	}
	source := map[string]string{}
	wantIDs := map[string]identity.NumericIdentity{}
	for i, c := range cases {
		key := c.lbls.Canonical()
		pr := idprobe.New(key, cluster0)
		for j, o := range c.objs {
			id := pr.Slot(o.pos)
			take(id, fmt.Sprintf("%s object %d", c.name, j))
			manager := "cilium-agent"
			if o.identityd {
				manager = crdstore.FieldManager
			}
			createStamped(t, api, dyn, id, c.lbls, manager, o.created)
			if j == c.want {
				wantIDs[key] = id
			}
		}
		// The source's ID of the set is held by another set in the
		// target.
		src := identity.NumericIdentity(300 + i)
		take(src, c.name+" in the source")
		createStamped(t, api, dyn, src, labels.MustParse(fmt.Sprintf("k8s:app=other-%d", i)), "cilium-agent", sec(0))
		source[src.String()] = key
	}
	seedEtcd(t, cli, "cilium-node", source)

	dry := options(KVStore, CRD, cli, cfg)
	dry.DryRun = true
	rep, err := Run(t.Context(), dry)
	if err != nil {
		t.Fatal(err)
	}
	planned := map[string]identity.NumericIdentity{}
	for _, c := range rep.Conflicts {
		planned[c.Labels] = identity.NumericIdentity(c.NewID)
	}

	before := crdVersions(t, cfg)
	node := startCRDNode(t, api, "node-a")
	for _, c := range cases {
		key := c.lbls.Canonical()
		id, _, err := node.Allocate(t.Context(), c.lbls)
		if err != nil {
			t.Fatalf("%s: allocating: %v", c.name, err)
		}
		if planned[key] != id.ID {
			t.Errorf("%s: the migration plan gives %d, a CRD store node answers %d", c.name, planned[key], id.ID)
		}
		if id.ID != wantIDs[key] {
			t.Errorf("%s: a CRD store node answers %d, the rule picks %d", c.name, id.ID, wantIDs[key])
		}
	}
	// The node answered from the objects the plan read: it created none.
	for name := range crdObjects(t, cfg) {
		if _, ok := before["ciliumidentities/"+name]; !ok {
			t.Errorf("the node created object %s", name)
		}
	}
}

// TestDuplicateMasterKeysHeldOnce: towards etcd, a label set the target
// holds at several master keys gets one reference key of the hold, naming
// the ID the plan reports, which is the ID an etcd node then adopts for
// it: the one other nodes' references name, else the smallest (the plan
// must not depend on the listing's order). Source duplicates present at
// several of those IDs are held once too. A dry run and a second run plan
// the same.
func TestDuplicateMasterKeysHeldOnce(t *testing.T) {
	t.Parallel()
	etcd := etcdtest.StartSingle(t)
	cli := etcd.Client(t)
	cfg := k8stest.Start(t).RESTConfig()
	set := map[string]labels.Labels{
		"a": labels.MustParse("k8s:app=a"),
		"b": labels.MustParse("k8s:app=b"),
		"c": labels.MustParse("k8s:app=c"),
	}
	a, b, c := set["a"].Canonical(), set["b"].Canonical(), set["c"].Canonical()
	z, y := canon(t, "k8s:app=z"), canon(t, "k8s:app=y")
	seedCRD(t, cfg, map[identity.NumericIdentity]labels.Labels{256: set["a"], 257: set["c"], 258: set["b"],
		700: set["a"], 40000: set["a"]})
	// A node references b at 30000 (and z, y at their IDs); nobody
	// references a or c.
	seedEtcd(t, cli, "cilium-node", map[string]string{"256": z, "258": y, "30000": b})
	for id, key := range map[identity.NumericIdentity]string{40000: a, 700: a, 800: b, 20000: c, 900: c} {
		if _, err := cli.Put(t.Context(), etcdstore.MasterKey(id), key); err != nil {
			t.Fatal(err)
		}
	}
	masters := etcdMasters(t, cli)
	wantConflicts := []Conflict{
		{ID: 256, Labels: a, TargetLabels: z, NewID: 700},
		{ID: 258, Labels: b, TargetLabels: y, NewID: 30000},
	}
	wantElsewhere := []Elsewhere{{ID: 257, Labels: c, TargetIDs: []uint32{900, 20000}}}
	check := func(what string, rep *Report) {
		t.Helper()
		if !reflect.DeepEqual(rep.Conflicts, wantConflicts) || !reflect.DeepEqual(rep.Elsewhere, wantElsewhere) ||
			!slices.Equal(ids(rep.Present), []uint32{700, 40000}) || len(rep.Created) != 0 || rep.NewIDsCreated != 0 {
			t.Errorf("%s: %+v, want conflicts %+v, elsewhere %+v, 700 and 40000 present, nothing created",
				what, rep, wantConflicts, wantElsewhere)
		}
	}
	dry := options(CRD, KVStore, cli, cfg)
	dry.DryRun = true
	rep, err := Run(t.Context(), dry)
	if err != nil {
		t.Fatal(err)
	}
	check("dry run", rep)
	rep, err = Run(t.Context(), options(CRD, KVStore, cli, cfg))
	if err != nil {
		t.Fatal(err)
	}
	check("run", rep)
	if got := etcdMasters(t, cli); !maps.Equal(got, masters) {
		t.Errorf("masters %v, want them unchanged: %v", got, masters)
	}
	want := map[string]identity.NumericIdentity{"a": 700, "b": 30000, "c": 900}
	checkHold := func(what string) {
		t.Helper()
		for name, id := range want {
			key := set[name].Canonical()
			resp, err := cli.Get(t.Context(), etcdstore.ReferencePrefix(key)+DefaultHoldNode)
			if err != nil {
				t.Fatal(err)
			}
			if len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != id.String() {
				t.Errorf("%s: hold reference of %s: %v, want one naming %d", what, key, resp.Kvs, id)
			}
		}
	}
	checkHold("run")
	if rep, err = Run(t.Context(), options(CRD, KVStore, cli, cfg)); err != nil {
		t.Fatal(err)
	}
	check("second run", rep)
	checkHold("second run")

	node := startEtcdNode(t, etcd.Endpoints()[0], "node-a")
	for name, id := range want {
		// A node that cannot settle the label set waits for its
		// references to agree: the bound turns that into a failure.
		ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
		got, _, err := node.Allocate(ctx, set[name])
		cancel()
		if err != nil || got.ID != id {
			t.Errorf("the etcd node allocates %s as %v (%v), want %d", set[name].Canonical(), got, err, id)
		}
	}
}

// TestDuplicateMasterKeysDisagreeingReferences: of a label set's master
// keys that other nodes' references name (they disagree, and nodes wait),
// the plan takes the smallest, never an unreferenced one; the hold's own
// reference from an earlier run does not count, since the run writes it
// again.
func TestDuplicateMasterKeysDisagreeingReferences(t *testing.T) {
	t.Parallel()
	cli := etcdtest.StartSingle(t).Client(t)
	cfg := k8stest.Start(t).RESTConfig()
	d, e := labels.MustParse("k8s:app=d"), labels.MustParse("k8s:app=e")
	w, v := canon(t, "k8s:app=w"), canon(t, "k8s:app=v")
	seedCRD(t, cfg, map[identity.NumericIdentity]labels.Labels{259: d, 260: e})
	seedEtcd(t, cli, "cilium-node", map[string]string{"259": w, "260": v})
	seedEtcd(t, cli, "node-x", map[string]string{"2000": d.Canonical()})
	seedEtcd(t, cli, "node-y", map[string]string{"1000": d.Canonical()})
	// An earlier run's reference names e's larger master key.
	seedEtcd(t, cli, DefaultHoldNode, map[string]string{"4000": e.Canonical()})
	for id, key := range map[identity.NumericIdentity]string{500: d.Canonical(), 3000: e.Canonical()} {
		if _, err := cli.Put(t.Context(), etcdstore.MasterKey(id), key); err != nil {
			t.Fatal(err)
		}
	}
	want := []Conflict{
		{ID: 259, Labels: d.Canonical(), TargetLabels: w, NewID: 1000},
		{ID: 260, Labels: e.Canonical(), TargetLabels: v, NewID: 3000},
	}
	for _, dry := range []bool{true, false} {
		o := options(CRD, KVStore, cli, cfg)
		o.DryRun = dry
		rep, err := Run(t.Context(), o)
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(rep.Conflicts, want) {
			t.Errorf("dry run %v: conflicts %+v, want %+v", dry, rep.Conflicts, want)
		}
	}
	for lbls, id := range map[string]string{d.Canonical(): "1000", e.Canonical(): "3000"} {
		resp, err := cli.Get(t.Context(), etcdstore.ReferencePrefix(lbls)+DefaultHoldNode)
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != id {
			t.Errorf("hold reference of %s: %v, want one naming %s", lbls, resp.Kvs, id)
		}
	}
}
