package etcdstore

import (
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/identityd/identityd/internal/eventually"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/labels"
)

// ciliumWriter writes global identities the way Cilium v1.16's kvstore
// allocator does (pkg/kvstore/allocator): keys built with path.Join, a
// lookup that lists path.Join(value prefix, labels) and keeps the keys
// whose last "/" follows the prefix, master keys created only if absent,
// references on the node's lease. It skips Cilium's lock, which changes no
// key that a reader sees once the allocation is done.
type ciliumWriter struct {
	cli   *clientv3.Client
	node  string
	lease clientv3.LeaseID
	next  int
}

func newCiliumWriter(t *testing.T, cli *clientv3.Client, node string, firstID int) *ciliumWriter {
	t.Helper()
	lease, err := cli.Grant(testCtx(t, 10*time.Second), 60)
	if err != nil {
		t.Fatal(err)
	}
	return &ciliumWriter{cli: cli, node: node, lease: lease.ID, next: firstID}
}

// lookup is Cilium's kvstoreBackend.Get.
func (w *ciliumWriter) lookup(t *testing.T, key string) identity.NumericIdentity {
	t.Helper()
	prefix := path.Join(IdentitiesPrefix, "value", key)
	resp, err := w.cli.Get(testCtx(t, 10*time.Second), prefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	for _, kv := range resp.Kvs {
		if strings.LastIndex(string(kv.Key), "/") == len(prefix) {
			if id, err := strconv.ParseUint(string(kv.Value), 10, 32); err == nil {
				return identity.NumericIdentity(id)
			}
		}
	}
	return 0
}

// allocate references the label set's identity, creating a master key
// with the next free ID when no node references it.
func (w *ciliumWriter) allocate(t *testing.T, key string) identity.NumericIdentity {
	t.Helper()
	ctx := testCtx(t, 10*time.Second)
	id := w.lookup(t, key)
	for id == 0 {
		master := path.Join(IdentitiesPrefix, "id", strconv.Itoa(w.next))
		w.next++
		resp, err := w.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(master), "=", 0)).
			Then(clientv3.OpPut(master, key)).Commit()
		if err != nil {
			t.Fatal(err)
		}
		if resp.Succeeded {
			id = identity.NumericIdentity(w.next - 1)
		}
	}
	ref := path.Join(IdentitiesPrefix, "value", key, w.node)
	if _, err := w.cli.Put(ctx, ref, id.String(), clientv3.WithLease(w.lease)); err != nil {
		t.Fatal(err)
	}
	return id
}

// masterKeysOf counts the master keys whose value is key.
func masterKeysOf(t *testing.T, cli *clientv3.Client, key string) int {
	t.Helper()
	resp, err := cli.Get(testCtx(t, 10*time.Second), MasterKeyPrefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, kv := range resp.Kvs {
		if string(kv.Value) == key {
			n++
		}
	}
	return n
}

// Label strings that path.Join changes, and ones it leaves alone but that
// hold characters a key layout could trip on.
var interopLabelStrings = []string{
	"k8s:a=x//y;",
	"k8s:a=u/./v;",
	"k8s:a=p/q/../r;",
	"k8s:a=trailing/;",
	"k8s:a=b=c;k8s:io.kubernetes.pod.namespace=ns;",
	"k8s:app.kubernetes.io/name=web;k8s:dir//x=1;",
	"container:a=..;k8s:b=/;",
}

// TestEtcdMixedWritersCleanedKeys runs identityd nodes beside a writer that
// builds keys the way Cilium v1.16 does, over label strings that path.Join
// cleans: each label set ends with one master key and one ID on every
// node, whichever writes first, and the garbage collection deletes no
// master key a Cilium node references.
func TestEtcdMixedWritersCleanedKeys(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	n1 := startEtcdNode(t, c, "node1")
	n2 := startEtcdNode(t, c, "node2")
	cilium := newCiliumWriter(t, cli, "cilium-node", 40000)
	ctx := testCtx(t, time.Minute)

	type held struct {
		key string
		id  identity.NumericIdentity
	}
	var all []held
	for i, key := range interopLabelStrings {
		lbls, err := labels.ParseCanonical(key)
		if err != nil {
			t.Fatalf("%q: %v", key, err)
		}
		var id identity.NumericIdentity
		if i%2 == 0 {
			// Cilium first, then identityd adopts.
			id = cilium.allocate(t, key)
			got, _, err := n1.alloc.Allocate(ctx, lbls)
			if err != nil {
				t.Fatalf("node1 after Cilium, %q: %v", key, err)
			}
			if got.ID != id {
				t.Errorf("%q: Cilium has %d, node1 %d", key, id, got.ID)
			}
		} else {
			// identityd first, then Cilium finds its reference.
			got, _, err := n1.alloc.Allocate(ctx, lbls)
			if err != nil {
				t.Fatalf("node1, %q: %v", key, err)
			}
			id = got.ID
			if cid := cilium.allocate(t, key); cid != id {
				t.Errorf("%q: node1 has %d, Cilium %d", key, id, cid)
			}
		}
		got, _, err := n2.alloc.Allocate(ctx, lbls)
		if err != nil {
			t.Fatalf("node2, %q: %v", key, err)
		}
		if got.ID != id {
			t.Errorf("%q: node2 has %d, others %d", key, got.ID, id)
		}
		if n := masterKeysOf(t, cli, key); n != 1 {
			t.Errorf("%q: %d master keys, want 1", key, n)
		}
		// Cilium's lookup finds identityd's references under the key it
		// builds itself.
		if w := cilium.lookup(t, key); w != id {
			t.Errorf("%q: Cilium's lookup finds %d, want %d", key, w, id)
		}
		all = append(all, held{key, id})
	}

	// identityd's nodes release everything; only the Cilium node
	// references the label sets now. GC must keep every master key.
	for _, h := range all {
		lbls, _ := labels.ParseCanonical(h.key)
		for _, n := range []*etcdNode{n1, n2} {
			id := n.alloc.LookupByLabels(lbls)
			if _, err := n.alloc.Release(ctx, id); err != nil {
				t.Fatal(err)
			}
		}
	}
	if _, err := n1.backend.collect(ctx); err != nil {
		t.Fatal(err)
	}
	for _, h := range all {
		if v, _, ok := getValue(t, cli, masterKey(h.id)); !ok || v != h.key {
			t.Errorf("GC deleted master key %d of %q, which the Cilium node references (now %q, %v)", h.id, h.key, v, ok)
		}
	}
}

// TestEtcdForeignKeysUnderPrefix checks that reference keys of a label set
// whose canonical string extends another's with "/" (a Cilium label source
// may hold "/") do not block the shorter label set's allocation.
func TestEtcdForeignKeysUnderPrefix(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	n1 := startEtcdNode(t, c, "node1")
	n2 := startEtcdNode(t, c, "node2")
	cilium := newCiliumWriter(t, cli, "cilium-node", 41000)
	ctx := testCtx(t, time.Minute)

	short := labels.MustParse("k8s:a=x")
	foreign := short.Canonical() + "/src:b=y;"
	fid := cilium.allocate(t, foreign)

	got, created, err := n1.alloc.Allocate(ctx, short)
	if err != nil {
		t.Fatalf("allocation blocked by a foreign key: %v", err)
	}
	if !created || got.ID == fid {
		t.Fatalf("got %d (created %v), the foreign label set has %d", got.ID, created, fid)
	}
	again, _, err := n2.alloc.Allocate(ctx, short)
	if err != nil || again.ID != got.ID {
		t.Fatalf("node2: %v, %v; node1 has %d", again, err, got.ID)
	}
	if w := cilium.lookup(t, short.Canonical()); w != got.ID {
		t.Fatalf("Cilium's lookup finds %d, want %d", w, got.ID)
	}
	if n := masterKeysOf(t, cli, short.Canonical()); n != 1 {
		t.Fatalf("%d master keys, want 1", n)
	}

	// GC keeps what is referenced, the foreign label set included, and
	// collects the shorter one once nobody references it, whatever lies
	// under its prefix.
	if _, err := n1.backend.collect(ctx); err != nil {
		t.Fatal(err)
	}
	if n := masterKeysOf(t, cli, short.Canonical()); n != 1 {
		t.Fatal("GC deleted a referenced master key")
	}
	for _, n := range []*etcdNode{n1, n2} {
		if _, err := n.alloc.Release(ctx, n.alloc.LookupByLabels(short)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := n1.backend.collect(ctx); err != nil {
		t.Fatal(err)
	}
	if n := masterKeysOf(t, cli, short.Canonical()); n != 0 {
		t.Fatal("GC kept an unreferenced master key because of a foreign key under its prefix")
	}
	if n := masterKeysOf(t, cli, foreign); n != 1 {
		t.Fatal("GC deleted the master key of the foreign label set, which the Cilium node references")
	}
}

// TestCreateTxnForeignRevision checks the compare that replaces "no
// reference key exists" when the prefix holds only other label sets' keys:
// a reference written after that revision makes the transaction fail.
func TestCreateTxnForeignRevision(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	ctx := testCtx(t, 30*time.Second)
	key := "k8s:a=x;"
	refs, locks := referencePrefix(key), lockPrefix(key)
	put, err := cli.Put(ctx, refs+"src:b=y;/other", "300")
	if err != nil {
		t.Fatal(err)
	}
	seen := put.Header.Revision
	lease, err := cli.Grant(ctx, 60)
	if err != nil {
		t.Fatal(err)
	}

	// A node references the label set after the scan at seen.
	if _, err := cli.Put(ctx, refs+"late-node", "301"); err != nil {
		t.Fatal(err)
	}
	resp, err := commitTxn(ctx, cli, createTxn(masterKey(302), refs, locks, "me", key, "302", lease.ID, seen))
	if err != nil {
		t.Fatal(err)
	}
	if resp.Succeeded {
		t.Fatal("create succeeded although a reference was written after the scan")
	}
	if _, err := cli.Delete(ctx, refs+"late-node"); err != nil {
		t.Fatal(err)
	}

	// Only the foreign key, unchanged since a later scan: it succeeds.
	now, err := cli.Get(ctx, refs, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	resp, err = commitTxn(ctx, cli, createTxn(masterKey(302), refs, locks, "me", key, "302", lease.ID, now.Header.Revision))
	if err != nil {
		t.Fatal(err)
	}
	if !resp.Succeeded {
		t.Fatal("create failed with only a foreign key under the prefix")
	}
}

// TestEtcdKeyLayoutRefused checks that a label set whose keys, cleaned as
// Cilium cleans them, would leave their prefix is refused before anything
// is written.
func TestEtcdKeyLayoutRefused(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	n1 := startEtcdNode(t, c, "node1")
	ctx := testCtx(t, 30*time.Second)
	for _, s := range []string{"k8s:x/../../id/5=v", "k8s:x/../../../../../etc=v"} {
		lbls, err := labels.Parse(s)
		if err != nil {
			t.Fatalf("%q: %v", s, err)
		}
		_, _, err = n1.alloc.Allocate(ctx, lbls)
		if !errors.Is(err, ErrKeyLayout) {
			t.Errorf("%q: %v, want ErrKeyLayout", s, err)
		}
	}
	// Only the node's own key (see claimNodeName) is there.
	if n := countKeys(t, cli, "") - countKeys(t, cli, NodeKeyPrefix); n != 0 {
		t.Fatalf("%d keys written for refused label sets", n)
	}
}

// TestEtcdKeyCollisionRefused checks that of two label strings that clean
// to the same reference key, the second is refused at once: in Cilium's
// layout their references cannot be told apart.
func TestEtcdKeyCollisionRefused(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	n1 := startEtcdNode(t, c, "node1")
	n2 := startEtcdNode(t, c, "node2")
	ctx := testCtx(t, 30*time.Second)
	first, _, err := n1.alloc.Allocate(ctx, labels.MustParse("k8s:a=x//y"))
	if err != nil {
		t.Fatal(err)
	}
	second := labels.MustParse("k8s:a=x/./y")
	for _, n := range []*etcdNode{n1, n2} {
		start := time.Now()
		got, _, err := n.alloc.Allocate(ctx, second)
		if !errors.Is(err, ErrKeyLayout) {
			t.Fatalf("%s: %v, %v; want ErrKeyLayout (the first has %d)", n.name, got, err, first.ID)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("%s: refusal took %v", n.name, d)
		}
	}
	if n := masterKeysOf(t, cli, second.Canonical()); n != 0 {
		t.Fatalf("%d master keys for the refused label set", n)
	}
}

// TestEtcdMasterKeyRecreatedWithReference checks that re-creating a
// deleted master key writes this node's reference in the same
// transaction: the master key's deleter (another node's GC, after an agent
// of the same node name deleted this node's references) saw none, and
// without it the next GC run deletes the master key again.
func TestEtcdMasterKeyRecreatedWithReference(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	// The periodic sync must not be what writes the reference here.
	n1 := startEtcdNode(t, c, "node1", func(_ *kvstore.Config, e *storeConfig) { e.KVStorePeriodicSync = time.Hour })
	n2 := startEtcdNode(t, c, "node2")
	ctx := testCtx(t, time.Minute)
	l := labels.MustParse("k8s:app=twice-named")
	id, _, err := n1.alloc.Allocate(ctx, l)
	if err != nil {
		t.Fatal(err)
	}
	// node2's GC collects what its cache holds: wait until its watch
	// has brought the master key.
	eventually.True(t, "node2 caches the master key", func() bool {
		_, ok := n2.backend.LookupByID(id.ID)
		return ok
	})
	if _, err := cli.Delete(ctx, refKey(l, "node1")); err != nil {
		t.Fatal(err)
	}
	if _, err := n2.backend.collect(ctx); err != nil {
		t.Fatal(err)
	}
	eventually.True(t, "master key and reference re-created", func() bool {
		v, _, ok := getValue(t, cli, masterKey(id.ID))
		r, _, rok := getValue(t, cli, refKey(l, "node1"))
		return ok && v == l.Canonical() && rok && r == id.ID.String()
	})
	// The next GC keeps it.
	if _, err := n2.backend.collect(ctx); err != nil {
		t.Fatal(err)
	}
	if v, _, ok := getValue(t, cli, masterKey(id.ID)); !ok || v != l.Canonical() {
		t.Fatal("the second GC run deleted the master key of an identity node1 uses")
	}
}

// TestEtcdPeriodicSyncRestoresReferences deletes a node's reference keys
// by hand: each node writes its own again within the sync interval, with
// the same IDs, and a released label set's reference is not written again.
func TestEtcdPeriodicSyncRestoresReferences(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	sync := func(_ *kvstore.Config, e *storeConfig) { e.KVStorePeriodicSync = 300 * time.Millisecond }
	n1 := startEtcdNode(t, c, "node1", sync)
	n2 := startEtcdNode(t, c, "node2", sync)
	ctx := testCtx(t, time.Minute)
	sets := []labels.Labels{labels.MustParse("k8s:app=a"), labels.MustParse("k8s:app=b")}
	ids := map[string]identity.NumericIdentity{}
	for _, l := range sets {
		for _, n := range []*etcdNode{n1, n2} {
			id, _, err := n.alloc.Allocate(ctx, l)
			if err != nil {
				t.Fatal(err)
			}
			ids[l.Canonical()] = id.ID
		}
	}
	released := labels.MustParse("k8s:app=released")
	rid, _, err := n1.alloc.Allocate(ctx, released)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := n1.alloc.Release(ctx, rid); err != nil {
		t.Fatal(err)
	}

	if _, err := cli.Delete(ctx, ReferenceKeyPrefix, clientv3.WithPrefix()); err != nil {
		t.Fatal(err)
	}
	eventually.Within(t, 10*time.Second, "every node's references written again", func() bool {
		for _, l := range sets {
			for _, node := range []string{"node1", "node2"} {
				v, _, ok := getValue(t, cli, refKey(l, node))
				if !ok || v != ids[l.Canonical()].String() {
					return false
				}
			}
		}
		return true
	})
	if _, _, ok := getValue(t, cli, refKey(released, "node1")); ok {
		t.Fatal("the reference of a released label set was written again")
	}
}

// startNodeErr starts a node that is expected to fail, with the cluster
// set by cluster (nil: cluster 0, "default"), and returns the start error.
func startNodeErr(t *testing.T, c *etcdtest.Cluster, name string, cluster func(*allocator.Config)) error {
	t.Helper()
	h := hive.New(statedir.Cell, job.Cell, statedb.Cell, kvstore.Cell, allocator.Cell, Cell,
		cell.Invoke(func(allocator.Allocator) {}))
	stateDir := t.TempDir()
	hive.AddConfigOverride(h, func(cfg *statedir.Config) { cfg.StateDir = stateDir })
	hive.AddConfigOverride(h, func(cfg *kvstore.Config) {
		cfg.KVStoreEndpoints = c.Endpoints()
		cfg.NodeName = name
		cfg.KVStoreRequestTimeout = 5 * time.Second
	})
	if cluster != nil {
		hive.AddConfigOverride(h, cluster)
	}
	hive.AddConfigOverride(h, func(cfg *globalstore.Config) { cfg.IdentityGCInterval = 0 })
	err := h.Start(hivetest.Logger(t), testCtx(t, time.Minute))
	// A failed start leaves the hooks that ran started, as hive.Run's
	// caller would stop them.
	h.Stop(hivetest.Logger(t), testCtx(t, time.Minute))
	return err
}

// putClaim writes a node key by hand, on a lease of its own.
func putClaim(t *testing.T, cli *clientv3.Client, node string, claim globalstore.NodeClaim) {
	t.Helper()
	lease, err := cli.Grant(testCtx(t, 10*time.Second), 60)
	if err != nil {
		t.Fatal(err)
	}
	v, _ := json.Marshal(claim)
	if _, err := cli.Put(testCtx(t, 10*time.Second), NodeKeyPrefix+node, string(v), clientv3.WithLease(lease.ID)); err != nil {
		t.Fatal(err)
	}
}

// TestEtcdSameNodeName checks that a second live agent with a node name in
// use on the etcd is refused at start, naming the first, while an agent
// that finds the key of one that is gone takes the name over.
func TestEtcdSameNodeName(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	n1 := startEtcdNode(t, c, "shared")
	err := startNodeErr(t, c, "shared", nil)
	if !errors.Is(err, ErrNodeNameInUse) || !strings.Contains(err.Error(), n1.backend.claim.Instance) {
		t.Fatalf("second agent with the same node name: %v", err)
	}
	// The first agent is untouched: its key is still its own.
	if v, _, ok := getValue(t, cli, NodeKeyPrefix+"shared"); !ok || !strings.Contains(v, n1.backend.claim.Instance) {
		t.Fatalf("node key after the refused start: %q %v", v, ok)
	}
	// Once it stopped, the name is free.
	n1.stop()
	if _, _, ok := getValue(t, cli, NodeKeyPrefix+"shared"); ok {
		t.Fatal("node key left after a clean stop")
	}
	n2 := startEtcdNode(t, c, "shared")
	n2.stop()

	// An agent on another host holds the name: refused.
	host, _ := os.Hostname()
	putClaim(t, cli, "remote", globalstore.NodeClaim{Instance: "feedface", Host: host + "-elsewhere", PID: os.Getpid()})
	if err := startNodeErr(t, c, "remote", nil); !errors.Is(err, ErrNodeNameInUse) || !strings.Contains(err.Error(), "-elsewhere") {
		t.Fatalf("name held on another host: %v", err)
	}

	// The key of a process of this host that has ended (a SIGKILLed
	// agent's, its lease not yet expired) is taken over.
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	putClaim(t, cli, "restarted", globalstore.NodeClaim{Instance: "deadbeef", Host: host, PID: gone.Process.Pid})
	n3 := startEtcdNode(t, c, "restarted")
	if v, _, _ := getValue(t, cli, NodeKeyPrefix+"restarted"); !strings.Contains(v, n3.backend.claim.Instance) {
		t.Fatalf("the key of a gone agent was not taken over: %q", v)
	}

	// So is the key of a killed agent its parent has not reaped yet (a
	// restart right after a SIGKILL).
	zombie := exec.Command("sleep", "60")
	if err := zombie.Start(); err != nil {
		t.Fatal(err)
	}
	zombie.Process.Kill()
	deadline := time.Now().Add(10 * time.Second)
	for globalstore.ProcessAlive(zombie.Process.Pid) {
		if time.Now().After(deadline) {
			t.Fatal("a killed, unreaped process counts as running")
		}
		time.Sleep(10 * time.Millisecond)
	}
	putClaim(t, cli, "killed", globalstore.NodeClaim{Instance: "cafebabe", Host: host, PID: zombie.Process.Pid})
	n4 := startEtcdNode(t, c, "killed")
	if v, _, _ := getValue(t, cli, NodeKeyPrefix+"killed"); !strings.Contains(v, n4.backend.claim.Instance) {
		t.Fatalf("the key of a killed, unreaped agent was not taken over: %q", v)
	}
	zombie.Wait()
	if !globalstore.ProcessAlive(os.Getpid()) {
		t.Fatal("this process counts as gone")
	}
}

// TestEtcdNodeNameConflictWhileRunning checks that a second writer of the
// node's name showing up while it runs (another agent's node key, a
// reference key on another lease) is counted and reported to health, and
// that the node writes its keys again.
func TestEtcdNodeNameConflictWhileRunning(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	n, prov := startCheckedNode(t, c, "busy")
	ctx := testCtx(t, time.Minute)
	l := labels.MustParse("k8s:app=busy")
	id, _, err := n.alloc.Allocate(ctx, l)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := n.backend.syncReferences(ctx); err != nil {
		t.Fatal(err)
	}
	if ok, _ := prov.Healthy(); !ok || n.backend.nodeCheckStats().NameConflicts != 0 {
		t.Fatalf("healthy %v, stats %+v before any conflict", ok, n.backend.nodeCheckStats())
	}

	// Another writer of the name rewrites the reference on its own lease.
	other, err := cli.Grant(ctx, 60)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, refKey(l, "busy"), id.ID.String(), clientv3.WithLease(other.ID)); err != nil {
		t.Fatal(err)
	}
	rewritten, err := n.backend.syncReferences(ctx)
	if err != nil {
		t.Fatal(err)
	}
	st := n.backend.nodeCheckStats()
	if rewritten != 0 || st.NameConflicts != 1 || st.ReferencesRewritten != 0 {
		t.Fatalf("rewritten %d, stats %+v; want one conflict and no rewrite", rewritten, st)
	}
	if ok, _ := prov.Healthy(); ok {
		t.Fatal("health is OK while another writer uses the node's name")
	}
	if live, _ := prov.Live(); !live {
		t.Fatal("a node-name conflict makes the agent not live: a liveness probe would restart it for nothing")
	}
	// The other writer's key is never written over: moved to this
	// node's lease, it would go with this node's stop.
	if _, lease, _ := getValue(t, cli, refKey(l, "busy")); lease != int64(other.ID) {
		t.Fatalf("the other writer's reference was written over (lease %x, not %x)", lease, other.ID)
	}

	// Another agent's node key.
	putClaim(t, cli, "busy", globalstore.NodeClaim{Instance: "0123456789abcdef", Host: "elsewhere", PID: 1})
	if _, err := n.backend.syncReferences(ctx); err != nil {
		t.Fatal(err)
	}
	// The check counts the node key and, again, the other writer's
	// reference.
	if n.backend.nodeCheckStats().NameConflicts != 3 {
		t.Fatalf("stats %+v; the other agent's node key was not counted", n.backend.nodeCheckStats())
	}

	// Once the other writer is gone, with its keys, a check writes this
	// node's reference again and health recovers.
	if _, err := cli.Delete(ctx, NodeKeyPrefix+"busy"); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Revoke(ctx, other.ID); err != nil {
		t.Fatal(err)
	}
	if rewritten, err := n.backend.syncReferences(ctx); err != nil || rewritten != 1 {
		t.Fatalf("sync after the other writer left: %d rewritten, %v; want 1", rewritten, err)
	}
	if ok, bad := prov.Healthy(); !ok {
		t.Fatalf("health after the conflict ended: %v", bad)
	}
	if v, _, ok := getValue(t, cli, NodeKeyPrefix+"busy"); !ok || !strings.Contains(v, n.backend.claim.Instance) {
		t.Fatalf("node key not claimed again: %q %v", v, ok)
	}
}

func inCluster(id uint32, name string) func(*allocator.Config) {
	return func(c *allocator.Config) { c.ClusterID, c.ClusterName = id, name }
}

// TestEtcdClusterMismatchRefused checks that a node whose cluster ID or
// name is not the etcd's refuses to start instead of adopting the etcd
// cluster's identities.
func TestEtcdClusterMismatchRefused(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	n0 := startEtcdNode(t, c, "node0")
	ctx := testCtx(t, time.Minute)
	if _, _, err := n0.alloc.Allocate(ctx, labels.MustParse("k8s:app=web", "k8s:io.cilium.k8s.policy.cluster=default")); err != nil {
		t.Fatal(err)
	}

	// Cluster 3 on cluster 0's etcd.
	err := startNodeErr(t, c, "node3", inCluster(3, "c3"))
	if !errors.Is(err, ErrClusterMismatch) || !strings.Contains(err.Error(), "cluster ID 0 and none of this node's --cluster-id 3") {
		t.Fatalf("cluster 3 on cluster 0's etcd: %v", err)
	}

	// The etcd's identities of cluster ID 0 name cluster "default".
	err = startNodeErr(t, c, "renamed", inCluster(0, "other"))
	if !errors.Is(err, ErrClusterMismatch) || !strings.Contains(err.Error(), `belong to cluster "default", not to this node's --cluster-name "other"`) {
		t.Fatalf("cluster renamed: %v", err)
	}

	// Cilium's cluster configuration names another ID for this name.
	if _, err := cli.Put(ctx, ClusterConfigPrefix+"default", `{"id":5,"capabilities":{}}`); err != nil {
		t.Fatal(err)
	}
	err = startNodeErr(t, c, "configured", inCluster(0, "default"))
	if !errors.Is(err, ErrClusterMismatch) || !strings.Contains(err.Error(), "gives cluster \"default\" the ID 5") {
		t.Fatalf("cluster config mismatch: %v", err)
	}
	if _, err := cli.Put(ctx, ClusterConfigPrefix+"default", `{"id":0,"capabilities":{}}`); err != nil {
		t.Fatal(err)
	}
	if err := startNodeErr(t, c, "matching", inCluster(0, "default")); err != nil {
		t.Fatalf("matching cluster refused: %v", err)
	}

	// A fresh etcd takes any cluster.
	fresh := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	if err := startNodeErr(t, fresh, "node3", inCluster(3, "c3")); err != nil {
		t.Fatalf("cluster 3 on a fresh etcd: %v", err)
	}
}

// TestEtcdDuplicateMasterKeys gives a label set two master keys, as a
// create that reaches etcd after the last reference to the first one was
// released does: a node whose cache knows the unreferenced one must adopt
// the ID that nodes reference, never use a second ID for the label set.
func TestEtcdDuplicateMasterKeys(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	ctx := testCtx(t, time.Minute)
	l := labels.MustParse("k8s:app=twice")
	key := l.Canonical()
	const unreferenced, referenced = 40000, 40001

	// The node's cache learns the unreferenced master key first.
	if _, err := cli.Put(ctx, masterKey(unreferenced), key); err != nil {
		t.Fatal(err)
	}
	n1 := startEtcdNode(t, c, "node1")
	other := newCiliumWriter(t, cli, "other", referenced)
	if got := other.allocate(t, key); got != referenced {
		// The writer found no reference and created the next ID.
		t.Fatalf("other node got %d", got)
	}
	eventually.True(t, "node1's cache knows both master keys", func() bool {
		_, ok := n1.backend.lookupLabels(referenced)
		return ok
	})
	if id, _ := n1.backend.cachedID(key); id != unreferenced {
		t.Fatalf("the cache maps the label set to %d; the test needs the unreferenced %d", id, unreferenced)
	}

	got, _, err := n1.alloc.Allocate(ctx, l)
	if err != nil {
		t.Fatal(err)
	}
	if got.ID != referenced {
		t.Fatalf("node1 uses %d for the label set while another node references %d", got.ID, referenced)
	}

	// With keys of a longer label set under the prefix too.
	if _, err := cli.Put(ctx, referencePrefix(key)+"src:b=y;/other", "40002"); err != nil {
		t.Fatal(err)
	}
	n2 := startEtcdNode(t, c, "node2")
	got2, _, err := n2.alloc.Allocate(ctx, l)
	if err != nil {
		t.Fatal(err)
	}
	if got2.ID != referenced {
		t.Fatalf("node2 uses %d, others %d", got2.ID, referenced)
	}
}

// startCheckedNode starts node name without its periodic check of its
// keys (the test runs syncReferences itself), reporting to the returned
// provider's node-name scope.
func startCheckedNode(t *testing.T, c *etcdtest.Cluster, name string) (*etcdNode, *health.Provider) {
	t.Helper()
	n := startEtcdNode(t, c, name, func(_ *kvstore.Config, e *storeConfig) { e.KVStorePeriodicSync = 0 })
	prov := health.NewProvider()
	n.backend.health = prov.Root().NewScope("node-name")
	return n, prov
}

// TestEtcdRestoreKeepsSplitOut loses a node's reference while another
// node creates the label set again under another ID: the node does not
// write its reference back (every later allocation would see the label set
// under two IDs), reports it, and writes it once the other ID is gone.
func TestEtcdRestoreKeepsSplitOut(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	n1, prov := startCheckedNode(t, c, "node1")
	ctx := testCtx(t, time.Minute)
	l := labels.MustParse("k8s:app=split")
	key := l.Canonical()
	mine, _, err := n1.alloc.Allocate(ctx, l)
	if err != nil {
		t.Fatal(err)
	}
	// node1's reference is lost; another node finds the label set
	// unreferenced and creates it with the next free ID of its own.
	if _, err := cli.Delete(ctx, refKey(l, "node1")); err != nil {
		t.Fatal(err)
	}
	other := newCiliumWriter(t, cli, "other", 45000)
	theirs := other.allocate(t, key)
	if theirs == mine.ID {
		t.Fatalf("the other node adopted %d; the test needs a second ID", theirs)
	}

	n, err := n1.backend.syncReferences(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, ok := getValue(t, cli, refKey(l, "node1")); ok || n != 0 {
		t.Fatalf("node1 wrote its reference to %d back (%d written) while others use %d", mine.ID, n, theirs)
	}
	if st := n1.backend.nodeCheckStats(); st.SplitLabelSets != 1 {
		t.Fatalf("stats %+v, want one split", st)
	}
	if ok, _ := prov.Healthy(); ok {
		t.Fatal("health is OK while the label set has two IDs")
	}
	// A node that allocates the label set now gets the others' ID.
	n3 := startEtcdNode(t, c, "node3")
	got, _, err := n3.alloc.Allocate(ctx, l)
	if err != nil || got.ID != theirs {
		t.Fatalf("node3: %v, %v; others use %d", got, err, theirs)
	}
	if _, err := n3.alloc.Release(ctx, got); err != nil {
		t.Fatal(err)
	}

	// Once the other ID is released everywhere, node1 writes its
	// reference again.
	if _, err := cli.Delete(ctx, refKey(l, "other")); err != nil {
		t.Fatal(err)
	}
	if n, err := n1.backend.syncReferences(ctx); err != nil || n != 1 {
		t.Fatalf("sync after the split ended: %d, %v", n, err)
	}
	if v, _, ok := getValue(t, cli, refKey(l, "node1")); !ok || v != mine.ID.String() {
		t.Fatalf("node1's reference: %q %v", v, ok)
	}
	if ok, bad := prov.Healthy(); !ok {
		t.Fatalf("health after the split ended: %v", bad)
	}
}

// TestEtcdTakenIdentityReported gives the ID of a label set node1 uses to
// another label set while node1's keys are gone, as happens when node1's
// lease is lost for longer than its TTL and a GC run frees the ID: other
// nodes now apply the other label set's policy to node1's users of the ID.
// node1 cannot take the ID back, but it must not look healthy: its watch
// delivers the changed master key (a delete and a create), node1 tries to
// re-create its own and finds the ID taken: it reports it (health degraded,
// counted) at once and at every check, until the ID is back.
func TestEtcdTakenIdentityReported(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	n1, prov := startCheckedNode(t, c, "node1")
	ctx := testCtx(t, time.Minute)
	l := labels.MustParse("k8s:app=taken")
	mine, _, err := n1.alloc.Allocate(ctx, l)
	if err != nil {
		t.Fatal(err)
	}
	// One change, as a relist after a compaction shows a delete and a
	// re-create: node1's reference is gone and the master key names
	// another label set, which another node references.
	other := labels.MustParse("k8s:app=newcomer").Canonical()
	if _, err := cli.Txn(ctx).Then(
		clientv3.OpDelete(refKey(l, "node1")),
		clientv3.OpPut(masterKey(mine.ID), other),
		clientv3.OpPut(path.Join(IdentitiesPrefix, "value", other, "other"), mine.ID.String()),
	).Commit(); err != nil {
		t.Fatal(err)
	}
	eventually.True(t, "node1 reports the taken ID from its watch", func() bool {
		ok, _ := prov.Healthy()
		return !ok && n1.backend.nodeCheckStats().TakenIdentities > 0
	})
	if v, _, _ := getValue(t, cli, masterKey(mine.ID)); v != other {
		t.Fatalf("master key of %d = %q after node1's repair, want the other label set's", mine.ID, v)
	}

	// Every check finds it again while it lasts.
	before := n1.backend.nodeCheckStats().TakenIdentities
	if n, err := n1.backend.syncReferences(ctx); err != nil || n != 0 {
		t.Fatalf("sync while the ID is taken: %d written, %v", n, err)
	}
	if ok, _ := prov.Healthy(); ok {
		t.Fatal("health is OK after a check while the ID this node uses belongs to another label set")
	}
	if got := n1.backend.nodeCheckStats().TakenIdentities; got != before+1 {
		t.Fatalf("taken identities %d after a check, want %d", got, before+1)
	}
	if _, _, ok := getValue(t, cli, refKey(l, "node1")); ok {
		t.Fatal("node1 wrote its reference while its ID belongs to another label set")
	}

	// The other label set's users are gone and the GC deletes its master
	// key: node1 re-creates its own and is healthy after the next check.
	if _, err := cli.Txn(ctx).Then(
		clientv3.OpDelete(path.Join(IdentitiesPrefix, "value", other, "other")),
		clientv3.OpDelete(masterKey(mine.ID)),
	).Commit(); err != nil {
		t.Fatal(err)
	}
	eventually.True(t, "node1 re-creates its master key once the ID is free", func() bool {
		v, _, ok := getValue(t, cli, masterKey(mine.ID))
		return ok && v == l.Canonical()
	})
	if _, err := n1.backend.syncReferences(ctx); err != nil {
		t.Fatal(err)
	}
	if ok, bad := prov.Healthy(); !ok {
		t.Fatalf("health after the ID came back: %v", bad)
	}
	if v, _, ok := getValue(t, cli, refKey(l, "node1")); !ok || v != mine.ID.String() {
		t.Fatalf("node1's reference after the ID came back: %q %v", v, ok)
	}
}

// TestEtcdForeignReferenceNotWrittenOver: a reference key under this
// node's name that another writer put there (as a Cilium agent whose node
// IP is this node's --node-name writes it, on its own lease) is reported as
// a node-name conflict when this node would write it, and never written
// over or deleted, by an allocation, a sync or a stop.
func TestEtcdForeignReferenceNotWrittenOver(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	ctx := testCtx(t, time.Minute)
	const node = "10.0.0.7"
	l := labels.MustParse("k8s:app=cilium-held", "k8s:io.kubernetes.pod.namespace=prod")
	const id = "31337"
	cilium, err := cli.Grant(ctx, 600)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, masterKey(31337), l.Canonical()); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, refKey(l, node), id, clientv3.WithLease(cilium.ID)); err != nil {
		t.Fatal(err)
	}
	untouched := func(when string) {
		t.Helper()
		v, lease, ok := getValue(t, cli, refKey(l, node))
		if !ok || v != id || lease != int64(cilium.ID) {
			t.Fatalf("%s: the other writer's reference is %q on lease %x (present %v), want %s on %x", when, v, lease, ok, id, cilium.ID)
		}
	}

	n, prov := startCheckedNode(t, c, node)
	_, _, err = n.alloc.Allocate(ctx, l)
	if !errors.Is(err, ErrNodeNameInUse) || !strings.Contains(err.Error(), "not by this agent") {
		t.Fatalf("allocating a label set another writer references under this node's name: %v", err)
	}
	untouched("after the allocation")
	if n.backend.nodeCheckStats().NameConflicts == 0 {
		t.Error("the conflict was not counted")
	}
	if ok, _ := prov.Healthy(); ok {
		t.Error("health is OK while another writer uses the node's name")
	}
	if _, err := n.backend.syncReferences(ctx); err != nil {
		t.Fatal(err)
	}
	untouched("after a sync")
	n.stop()
	untouched("after the stop")

	// A restarted agent finds it again at its first allocation.
	n2, _ := startCheckedNode(t, c, node)
	if _, _, err := n2.alloc.Allocate(ctx, l); !errors.Is(err, ErrNodeNameInUse) {
		t.Fatalf("allocation after a restart: %v", err)
	}
	n2.stop()
	untouched("after the second stop")
}
