package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/identityd/identityd/internal/eventually"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/allocator/globalstore/storetest"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/allocatortest"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/labels"
)

// etcdNode is one agent: a hive with the allocator and kvstore cells
// talking to a test etcd.
type etcdNode struct {
	t       testing.TB
	name    string
	h       *hive.Hive
	alloc   allocator.Allocator
	kv      *kvstore.Client
	backend *Store
	once    sync.Once
}

type nodeOpt func(kv *kvstore.Config, e *storeConfig)

// storeConfig is what a nodeOpt sets of the store: the stores' shared
// configuration and the etcd store's own.
type storeConfig struct {
	sharedConfig
	Config
}

type sharedConfig = globalstore.Config

func startEtcdNode(tb testing.TB, c *etcdtest.Cluster, name string, opts ...nodeOpt) *etcdNode {
	tb.Helper()
	return startEtcdNodeWith(tb, c, name, hive.DefaultOptions(), nil, opts...)
}

// startEtcdNodeWith is startEtcdNode with the hive's options and extra
// cells.
func startEtcdNodeWith(tb testing.TB, c *etcdtest.Cluster, name string, hopts hive.Options, extra []cell.Cell, opts ...nodeOpt) *etcdNode {
	tb.Helper()
	n := &etcdNode{t: tb, name: name}
	n.h = hive.NewWithOptions(hopts, append([]cell.Cell{
		statedir.Cell, job.Cell, statedb.Cell, kvstore.Cell, allocator.Cell, Cell,
		cell.Invoke(func(a allocator.Allocator, kv *kvstore.Client, b *Store) {
			n.alloc, n.kv, n.backend = a, kv, b
		}),
	}, extra...)...)
	configureNode(tb, n.h, c, name, opts...)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := n.h.Start(nodeLogger(tb), ctx); err != nil {
		tb.Fatalf("starting node %s: %v", name, err)
	}
	tb.Cleanup(n.stop)
	if n.backend == nil {
		tb.Fatalf("node %s has no etcd backend", name)
	}
	return n
}

// configureNode sets the configuration of node name's hive h: a state
// directory of its own, c's endpoints, and opts.
func configureNode(tb testing.TB, h *hive.Hive, c *etcdtest.Cluster, name string, opts ...nodeOpt) {
	stateDir := tb.TempDir()
	hive.AddConfigOverride(h, func(cfg *statedir.Config) { cfg.StateDir = stateDir })
	hive.AddConfigOverride(h, func(cfg *kvstore.Config) {
		cfg.KVStoreEndpoints = c.Endpoints()
		cfg.NodeName = name
		cfg.KVStoreDialTimeout = 10 * time.Second
		cfg.KVStoreRequestTimeout = 5 * time.Second
		for _, o := range opts {
			o(cfg, new(storeConfig))
		}
	})
	hive.AddConfigOverride(h, func(cfg *Config) {
		e := storeConfig{Config: *cfg}
		for _, o := range opts {
			o(new(kvstore.Config), &e)
		}
		*cfg = e.Config
	})
	hive.AddConfigOverride(h, func(cfg *globalstore.Config) {
		// Tests run the GC themselves unless they ask for the job.
		e := storeConfig{sharedConfig: *cfg}
		e.IdentityGCInterval = 0
		for _, o := range opts {
			o(new(kvstore.Config), &e)
		}
		*cfg = e.sharedConfig
	})
}

// nodeLogger logs a node's hive to the test; a benchmark, which prints
// whatever it logs among its results, gets warnings and errors only.
func nodeLogger(tb testing.TB) *slog.Logger {
	if _, ok := tb.(*testing.B); ok {
		return hivetest.Logger(tb, hivetest.LogLevel(slog.LevelWarn))
	}
	return hivetest.Logger(tb)
}

func (n *etcdNode) stop() {
	n.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := n.h.Stop(nodeLogger(n.t), ctx); err != nil {
			n.t.Errorf("stopping node %s: %v", n.name, err)
		}
	})
}

func (n *etcdNode) txns() uint64 { return n.kv.RequestCounts()["Txn"] }

func testCtx(tb testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	tb.Cleanup(cancel)
	return ctx
}

func getValue(tb testing.TB, cli *clientv3.Client, key string) (string, int64, bool) {
	tb.Helper()
	resp, err := cli.Get(testCtx(tb, 10*time.Second), key)
	if err != nil {
		tb.Fatalf("get %s: %v", key, err)
	}
	if len(resp.Kvs) == 0 {
		return "", 0, false
	}
	return string(resp.Kvs[0].Value), resp.Kvs[0].Lease, true
}

func countKeys(tb testing.TB, cli *clientv3.Client, prefix string) int64 {
	tb.Helper()
	resp, err := cli.Get(testCtx(tb, 30*time.Second), prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		tb.Fatalf("count %s: %v", prefix, err)
	}
	return resp.Count
}

func refKey(lbls labels.Labels, node string) string {
	return referencePrefix(lbls.Canonical()) + node
}

func TestEtcdAllocateAdoptReleaseGC(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	n1 := startEtcdNode(t, c, "node1")
	n2 := startEtcdNode(t, c, "node2")
	ctx := testCtx(t, time.Minute)

	// node2 observes what node1 creates.
	seen := make(chan allocator.Change, 64)
	octx, ocancel := context.WithCancel(ctx)
	defer ocancel()
	n2.alloc.Observe(octx, func(ch allocator.Change) {
		if ch.Kind != allocator.ChangeSync && !ch.ID.IsReserved() {
			seen <- ch
		}
	}, func(error) {})

	web := labels.MustParse("k8s:app=web", "k8s:io.kubernetes.pod.namespace=default")
	before := n1.txns()
	id, allocated, err := n1.alloc.Allocate(ctx, web)
	if err != nil || !allocated {
		t.Fatalf("new identity: allocated %v, err %v", allocated, err)
	}
	if got := n1.txns() - before; got != 1 {
		t.Fatalf("new identity cost %d transactions, want 1", got)
	}
	if id.ID < 256 || id.ID > 65535 {
		t.Fatalf("ID %d outside cluster 0's range", id.ID)
	}
	if v, _, ok := getValue(t, cli, masterKey(id.ID)); !ok || v != web.Canonical() {
		t.Fatalf("master key = %q %v, want %q", v, ok, web.Canonical())
	}
	if v, lease, ok := getValue(t, cli, refKey(web, "node1")); !ok || v != id.ID.String() || lease == 0 {
		t.Fatalf("reference key = %q lease %x %v", v, lease, ok)
	}

	// A held label set costs nothing.
	reqs := n1.kv.RequestCounts()
	for range 100 {
		if got, _, err := n1.alloc.Allocate(ctx, web); err != nil || got.ID != id.ID {
			t.Fatalf("held label set: %v %v", got, err)
		}
	}
	after := n1.kv.RequestCounts()
	for _, m := range []string{"Txn", "Range", "Put", "DeleteRange"} {
		if after[m] != reqs[m] {
			t.Fatalf("held label set cost %d %s requests", after[m]-reqs[m], m)
		}
	}

	// Watch: node2 learns of it by ID and through Observe.
	eventually.True(t, "node2 sees the identity", func() bool { return n2.alloc.LookupByID(id.ID) != nil })
	select {
	case ch := <-seen:
		if ch.Kind != allocator.ChangeUpsert || ch.ID != id.ID || !ch.Labels.Equal(web) {
			t.Fatalf("node2 observed %+v", ch)
		}
	case <-ctx.Done():
		t.Fatal("node2 observed nothing")
	}

	// Adoption of an identity node2's cache knows: one transaction.
	before = n2.txns()
	id2, allocated, err := n2.alloc.Allocate(ctx, web)
	if err != nil || allocated || id2.ID != id.ID {
		t.Fatalf("adoption: %v allocated %v err %v", id2, allocated, err)
	}
	if got := n2.txns() - before; got != 1 {
		t.Fatalf("adopting a known identity cost %d transactions, want 1", got)
	}

	// Adoption of one the cache does not know yet: at most two. The
	// identity is written behind node2's back, as a Cilium agent would.
	db := labels.MustParse("k8s:app=db")
	if _, err := cli.Txn(ctx).Then(
		clientv3.OpPut(masterKey(4242), db.Canonical()),
		clientv3.OpPut(refKey(db, "cilium-node"), "4242"),
	).Commit(); err != nil {
		t.Fatal(err)
	}
	before = n2.txns()
	id3, allocated, err := n2.alloc.Allocate(ctx, db)
	if err != nil || allocated || id3.ID != 4242 {
		t.Fatalf("adopting a foreign identity: %v allocated %v err %v", id3, allocated, err)
	}
	if got := n2.txns() - before; got > 2 {
		t.Fatalf("adopting an unknown identity cost %d transactions, want at most 2", got)
	}

	// Release: only the last local reference deletes the node's
	// reference key, with one transaction (the delete, guarded by the
	// key's revision).
	before = n1.txns()
	dels := n1.kv.RequestCounts()["DeleteRange"]
	for range 100 {
		if released, err := n1.alloc.Release(ctx, id); err != nil || released {
			t.Fatalf("non-final release: %v %v", released, err)
		}
	}
	if n1.txns() != before {
		t.Fatalf("non-final releases cost %d transactions, want 0", n1.txns()-before)
	}
	if released, err := n1.alloc.Release(ctx, id); err != nil || !released {
		t.Fatalf("release: %v %v", released, err)
	}
	if got, txns := n1.kv.RequestCounts()["DeleteRange"]-dels, n1.txns()-before; got != 0 || txns != 1 {
		t.Fatalf("releases cost %d deletes and %d transactions, want 0 and 1", got, txns)
	}
	if _, _, ok := getValue(t, cli, refKey(web, "node1")); ok {
		t.Fatal("node1's reference key survived its release")
	}
	if _, _, ok := getValue(t, cli, masterKey(id.ID)); !ok {
		t.Fatal("master key deleted by a release")
	}

	// GC keeps what someone references.
	if res, err := n1.backend.collect(ctx); err != nil || res.Deleted != 0 {
		t.Fatalf("GC with every identity referenced: deleted %d, err %v", res.Deleted, err)
	}
	if _, err := n2.alloc.Release(ctx, id2); err != nil {
		t.Fatal(err)
	}
	res, err := n1.backend.collect(ctx)
	if err != nil || res.Deleted != 1 {
		t.Fatalf("GC: deleted %d, err %v; want 1", res.Deleted, err)
	}
	if _, _, ok := getValue(t, cli, masterKey(id.ID)); ok {
		t.Fatal("GC left the unused master key")
	}
	if _, _, ok := getValue(t, cli, masterKey(4242)); !ok {
		t.Fatal("GC deleted a referenced master key")
	}
	if s := n1.backend.gcStats(); s.Deleted != 1 || s.Runs != 2 {
		t.Fatalf("GC stats %+v", s)
	}
	eventually.True(t, "the delete reaches node2", func() bool { return n2.alloc.LookupByID(id.ID) == nil })
	for {
		select {
		case ch := <-seen:
			if ch.Kind == allocator.ChangeDelete && ch.ID == id.ID {
				return
			}
		case <-ctx.Done():
			t.Fatal("node2 did not observe the delete")
		}
	}
}

// GC must not delete a master key that gains a reference after the
// candidates were chosen: the transaction's compares prove it unused.
func TestEtcdGCRace(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	n1 := startEtcdNode(t, c, "node1", func(_ *kvstore.Config, e *storeConfig) {
		e.IdentityGCInterval = 50 * time.Millisecond
		e.IdentityGCRateLimit = 1_000_000
	})
	ctx := testCtx(t, time.Minute)
	lbls := labels.MustParse("k8s:app=gc")
	id, _, err := n1.alloc.Allocate(ctx, lbls)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := n1.alloc.Release(ctx, id); err != nil {
		t.Fatal(err)
	}
	// The periodic GC collects it.
	eventually.True(t, "periodic GC", func() bool {
		_, _, ok := getValue(t, cli, masterKey(id.ID))
		return !ok
	})
	// The GC counts the deletion once etcd answered it, which may be
	// after the key was seen gone here.
	eventually.True(t, "GC stats counting the deletion", func() bool {
		return n1.backend.gcStats().Deleted >= 1
	})
}

func TestEtcdRelistAfterCompaction(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	n1 := startEtcdNode(t, c, "node1")
	ctx := testCtx(t, time.Minute)

	put := func(id int, l string) {
		t.Helper()
		if _, err := cli.Put(ctx, masterKey(identity.NumericIdentity(id)), labels.MustParse(l).Canonical()); err != nil {
			t.Fatal(err)
		}
	}
	put(1000, "k8s:app=a")
	put(1001, "k8s:app=b")
	put(1002, "k8s:app=c")

	// A second backend on node1's client whose cache is a listing that
	// falls behind: changes happen and etcd compacts them away before its
	// watch starts.
	rec := &recorder{}
	b := newUnstarted(hivetest.Logger(t), n1.kv, identity.ClusterInfo{Name: "default", MaxConnectedClusters: 255}, globalstore.DefaultConfig, DefaultConfig, new(globalstore.Sink))
	b.events = rec
	rev, err := b.list(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got := rec.take(); len(got) != 3 {
		t.Fatalf("first listing reported %v", got)
	}
	if _, err := cli.Delete(ctx, masterKey(1000)); err != nil {
		t.Fatal(err)
	}
	put(1003, "k8s:app=d")
	put(1001, "k8s:app=b") // rewritten, unchanged
	put(1002, "k8s:app=c2")
	resp, err := cli.Put(ctx, "unrelated", "x")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Compact(ctx, resp.Header.Revision); err != nil {
		t.Fatal(err)
	}
	if err := b.watch(ctx, rev+1); !errors.Is(err, rpctypes.ErrCompacted) {
		t.Fatalf("watch behind a compaction: %v, want ErrCompacted", err)
	}
	if _, err := b.list(ctx); err != nil {
		t.Fatal(err)
	}
	got := rec.take()
	want := []string{"delete 1000 k8s:app=a", "delete 1002 k8s:app=c", "upsert 1002 k8s:app=c2", "upsert 1003 k8s:app=d"}
	if strings.Join(got, ",") != strings.Join(want, ",") {
		t.Fatalf("re-list reported %v, want only the differences %v", got, want)
	}
	if l, ok := b.LookupByID(1002); !ok || l.Canonical() != labels.MustParse("k8s:app=c2").Canonical() {
		t.Fatalf("cache has %v for 1002", l)
	}

	// Unparsable values and IDs are skipped; other clusters' IDs kept.
	if _, err := cli.Put(ctx, MasterKeyPrefix+"notanumber", "k8s:x=y;"); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, masterKey(1004), "garbage"); err != nil {
		t.Fatal(err)
	}
	put(70000, "k8s:app=othercluster")
	if _, err := b.list(ctx); err != nil {
		t.Fatal(err)
	}
	if got := rec.take(); strings.Join(got, ",") != "upsert 70000 k8s:app=othercluster" {
		t.Fatalf("listing with invalid keys reported %v", got)
	}
	if b.pool.InRange(70000) {
		t.Fatal("another cluster's ID is in this cluster's pool")
	}

	// The node's own cache, behind nothing, followed all of it by watch.
	eventually.True(t, "node1's watch", func() bool {
		_, ok1 := n1.backend.LookupByID(1003)
		_, ok2 := n1.backend.LookupByID(1000)
		return ok1 && !ok2
	})
}

type recorder struct {
	mu     sync.Mutex
	events []string
}

func (r *recorder) Upsert(id identity.NumericIdentity, l labels.Labels) { r.add("upsert", id, l) }
func (r *recorder) Delete(id identity.NumericIdentity, l labels.Labels) { r.add("delete", id, l) }
func (r *recorder) Synced()                                             {}
func (r *recorder) add(kind string, id identity.NumericIdentity, l labels.Labels) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, fmt.Sprintf("%s %d %s", kind, id, strings.Join(l.Strings(), "+")))
}

func (r *recorder) take() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.events
	r.events = nil
	sortStrings(out)
	return out
}

func sortStrings(s []string) {
	for i := 1; i < len(s); i++ {
		for j := i; j > 0 && s[j] < s[j-1]; j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
}

func TestEtcdLeaseLossRecovery(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	// The shortest TTL makes the keepalive notice a revocation within
	// seconds.
	n1 := startEtcdNode(t, c, "node1", func(kv *kvstore.Config, _ *storeConfig) { kv.KVStoreLeaseTTL = kvstore.MinLeaseTTL })
	ctx := testCtx(t, 2*time.Minute)

	var sets []labels.Labels
	var ids []*identity.Identity
	for i := range 20 {
		l := labels.MustParse("k8s:app=lease" + strconv.Itoa(i))
		id, _, err := n1.alloc.Allocate(ctx, l)
		if err != nil {
			t.Fatal(err)
		}
		sets, ids = append(sets, l), append(ids, id)
	}
	_, lease, ok := getValue(t, cli, refKey(sets[0], "node1"))
	if !ok {
		t.Fatal("no reference key")
	}
	// Someone else revokes the node's lease: its references vanish.
	if _, err := cli.Revoke(ctx, clientv3.LeaseID(lease)); err != nil {
		t.Fatal(err)
	}
	// And deletes a master key meanwhile, as a GC seeing no reference
	// would.
	if _, err := cli.Delete(ctx, masterKey(ids[1].ID)); err != nil {
		t.Fatal(err)
	}
	restored := func() bool {
		for i, l := range sets {
			v, newLease, ok := getValue(t, cli, refKey(l, "node1"))
			if !ok || v != ids[i].ID.String() || newLease == lease {
				return false
			}
			if m, _, ok := getValue(t, cli, masterKey(ids[i].ID)); !ok || m != l.Canonical() {
				return false
			}
		}
		return true
	}
	// Nothing writes: the keepalive notices the loss.
	eventually.Within(t, time.Minute, "references restored with a new lease", restored)

	// Revoked again, and this time a write notices: etcd refuses the
	// lease, the allocation retries with a new one, and the references
	// come back.
	_, lease, _ = getValue(t, cli, refKey(sets[0], "node1"))
	if _, err := cli.Revoke(ctx, clientv3.LeaseID(lease)); err != nil {
		t.Fatal(err)
	}
	if _, allocated, err := n1.alloc.Allocate(ctx, labels.MustParse("k8s:app=after-loss")); err != nil || !allocated {
		t.Fatalf("allocation after lease loss: %v %v", allocated, err)
	}
	eventually.True(t, "references restored after a refused write", restored)

	// The restored references are released like any other: each release
	// deletes the reference written by the restore.
	for i, id := range ids {
		if released, err := n1.alloc.Release(ctx, id); err != nil || !released {
			t.Fatalf("release after the restore: %v %v", released, err)
		}
		if _, _, ok := getValue(t, cli, refKey(sets[i], "node1")); ok {
			t.Fatalf("reference of %s left after its release", sets[i])
		}
	}
}

// startBareStore starts the etcd store of node name without an allocator,
// keeping its references in the returned record.
func startBareStore(t *testing.T, c *etcdtest.Cluster, name string, leaseTTL time.Duration) (*Store, *storetest.Refs) {
	t.Helper()
	var b *Store
	refs := storetest.NewRefs()
	h := hive.New(
		statedir.Cell, job.Cell, statedb.Cell, kvstore.Cell, Cell,
		cell.Provide(func() identity.ClusterInfo { return identity.ClusterInfo{Name: "default"} }, globalstore.NewSinks),
		cell.Config(globalstore.DefaultConfig),
		cell.Invoke(func(sinks *globalstore.Sinks) { sinks.For(identity.AllocationModeKVStore).Bind(nil, refs) }),
		cell.Invoke(func(backend *Store) { b = backend }),
	)
	configureNode(t, h, c, name, func(kv *kvstore.Config, _ *storeConfig) { kv.KVStoreLeaseTTL = leaseTTL })
	log := nodeLogger(t)
	if err := h.Start(log, testCtx(t, time.Minute)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Stop(log, testCtx(t, time.Minute)) })
	if b == nil {
		t.Fatal("no etcd store")
	}
	return b, refs
}

// An allocation whose reference is written, and whose lease is lost before
// the allocator has recorded the reference: the repair that the loss
// starts must find the reference in the record, or the node uses an
// identity no reference protects and another node's GC may delete it. The
// store records the reference under the lock that the repair waits for,
// so the repair runs after the record, and writes the reference again.
// The record below revokes the lease and waits until the repair is
// waiting for that lock before it records.
func TestEtcdLeaseLostBeforeRecord(t *testing.T) {
	for _, tc := range []struct {
		name    string
		adopted bool
	}{{"created", false}, {"adopted", true}} {
		t.Run(tc.name, func(t *testing.T) {
			c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
			cli := c.Client(t)
			b, refs := startBareStore(t, c, "node1", kvstore.MinLeaseTTL)
			ctx := testCtx(t, 2*time.Minute)
			l := labels.MustParse("k8s:app=recorded")
			ref := refKey(l, "node1")
			if tc.adopted {
				// Another node's identity, which the cache knows.
				if _, err := cli.Put(ctx, masterKey(40000), l.Canonical()); err != nil {
					t.Fatal(err)
				}
				eventually.True(t, "the cache knows the identity", func() bool {
					id, ok := b.cachedID(l.Canonical())
					return ok && id == 40000
				})
			}

			var revoked int64
			id, allocated, err := b.Allocate(ctx, l, func(r *globalstore.Reference) {
				_, revoked, _ = getValue(t, cli, ref)
				if _, err := cli.Revoke(ctx, clientv3.LeaseID(revoked)); err != nil {
					t.Error(err)
				}
				eventually.Within(t, time.Minute, "the lease loss is noticed", func() bool {
					select {
					case <-b.kv.LeaseLost(clientv3.LeaseID(revoked)):
						return true
					default:
						return false
					}
				})
				// A writer waiting makes TryRLock fail: the repair is
				// waiting for the lock this record runs under. A repair
				// that found nothing to restore leaves no lease.
				var ranFirst bool
				eventually.Within(t, time.Minute, "the repair waits for the allocation", func() bool {
					if ranFirst = b.lease.Load() == 0; ranFirst {
						return true
					}
					if b.writeMu.TryRLock() {
						b.writeMu.RUnlock()
						return false
					}
					return true
				})
				if ranFirst {
					t.Error("the lost lease's repair ran before the allocation recorded its reference")
				}
				refs.Record(r)
			})
			if t.Failed() {
				return
			}
			if err != nil || allocated == tc.adopted {
				t.Fatalf("allocate: %d %v %v", id, allocated, err)
			}
			if tc.adopted && id != 40000 {
				t.Fatalf("adopted %d, want 40000", id)
			}
			var rev int64
			eventually.Within(t, time.Minute, "the reference is written again with a new lease", func() bool {
				resp, err := cli.Get(ctx, ref)
				if err != nil || len(resp.Kvs) != 1 {
					return false
				}
				kv := resp.Kvs[0]
				rev = kv.ModRevision
				return string(kv.Value) == id.String() && kv.Lease != revoked && kv.Lease != 0
			})
			// The record takes the rewrite's revision once the
			// repair's write has returned, a moment after etcd shows
			// the key: the release deletes it.
			var r *globalstore.Reference
			eventually.Within(t, time.Minute, "the record holds the token of the rewrite", func() bool {
				resp, err := cli.Get(ctx, ref)
				if err != nil || len(resp.Kvs) != 1 {
					return false
				}
				rev = resp.Kvs[0].ModRevision
				r = refs.ByID(id)
				return r != nil && r.Token() == rev
			})
			if err := b.Release(ctx, r); err != nil {
				t.Fatal(err)
			}
			if _, _, ok := getValue(t, cli, ref); ok {
				t.Fatal("reference left after the release")
			}
		})
	}
}

// TestEtcdLateReleaseKeepsNewerReference replays a release's delete after
// the label set was allocated again, as etcd applies a request that was
// sent to a stalled member, given up on by the node and proposed when the
// member resumed. The newer reference must stay: without it the node
// would hold an identity no reference protects, and another node could
// allocate a second ID for the label set.
func TestEtcdLateReleaseKeepsNewerReference(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	n1 := startEtcdNode(t, c, "node1")
	ctx := testCtx(t, time.Minute)
	l := labels.MustParse("k8s:app=late")
	ref := refKey(l, "node1")

	id, _, err := n1.alloc.Allocate(ctx, l)
	if err != nil {
		t.Fatal(err)
	}
	rev := n1.backend.heldRef(id.ID).Token()
	resp, err := cli.Get(ctx, ref)
	if err != nil || len(resp.Kvs) != 1 || resp.Kvs[0].ModRevision != rev {
		t.Fatalf("reference key %v, recorded revision %d: %v", resp.Kvs, rev, err)
	}
	// The delete the first release sends, held back.
	late := releaseTxn(cli.Txn(ctx), ref, rev)
	if released, err := n1.alloc.Release(ctx, id); err != nil || !released {
		t.Fatalf("release: %v %v", released, err)
	}
	if _, _, ok := getValue(t, cli, ref); ok {
		t.Fatal("reference left after the release")
	}
	again, _, err := n1.alloc.Allocate(ctx, l)
	if err != nil || again.ID != id.ID {
		t.Fatalf("allocating again: %v %v", again, err)
	}
	if _, _, ok := getValue(t, cli, ref); !ok {
		t.Fatal("no reference after allocating again")
	}

	lateResp, err := late.Commit()
	if err != nil {
		t.Fatal(err)
	}
	if lateResp.Succeeded {
		t.Fatal("the late delete removed the newer reference")
	}
	if _, _, ok := getValue(t, cli, ref); !ok {
		t.Fatal("the newer reference is gone")
	}
	// The second release deletes the second reference.
	if released, err := n1.alloc.Release(ctx, again); err != nil || !released {
		t.Fatalf("second release: %v %v", released, err)
	}
	if _, _, ok := getValue(t, cli, ref); ok {
		t.Fatal("reference left after the second release")
	}
}

func TestEtcdMasterKeyProtection(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	n1 := startEtcdNode(t, c, "node1")
	ctx := testCtx(t, time.Minute)
	l := labels.MustParse("k8s:app=protected")
	id, _, err := n1.alloc.Allocate(ctx, l)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Delete(ctx, masterKey(id.ID)); err != nil {
		t.Fatal(err)
	}
	eventually.True(t, "master key re-created", func() bool {
		v, _, ok := getValue(t, cli, masterKey(id.ID))
		return ok && v == l.Canonical()
	})
	// A master key of a label set the node released is not protected.
	if _, err := n1.alloc.Release(ctx, id); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Delete(ctx, masterKey(id.ID)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	if _, _, ok := getValue(t, cli, masterKey(id.ID)); ok {
		t.Fatal("master key of a released label set was re-created")
	}
}

func TestEtcdCiliumLock(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	n1 := startEtcdNode(t, c, "node1")
	ctx := testCtx(t, time.Minute)
	l := labels.MustParse("k8s:app=locked")
	lock := lockPrefix(l.Canonical()) + "694d7a4c1e2b3c4d"
	if _, err := cli.Put(ctx, lock, ""); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, _, err := n1.alloc.Allocate(ctx, l)
		done <- err
	}()
	select {
	case err := <-done:
		t.Fatalf("allocation went through a held lock: %v", err)
	case <-time.After(500 * time.Millisecond):
	}
	if n := countKeys(t, cli, referencePrefix(l.Canonical())); n != 0 {
		t.Fatalf("%d reference keys written under a held lock", n)
	}
	if _, err := cli.Delete(ctx, lock); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-ctx.Done():
		t.Fatal("allocation did not resume after the lock was released")
	}
	if n := countKeys(t, cli, referencePrefix(l.Canonical())); n != 1 {
		t.Fatalf("%d reference keys, want 1", n)
	}
}

func TestEtcdTLS(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithTLS(nil), etcdtest.WithUnsafeNoFsync())
	certs := c.Certs()
	n1 := startEtcdNode(t, c, "node1", func(kv *kvstore.Config, _ *storeConfig) {
		kv.KVStoreCAFile = certs.CAFile
		kv.KVStoreCertFile = certs.ClientCertFile
		kv.KVStoreKeyFile = certs.ClientKeyFile
	})
	id, allocated, err := n1.alloc.Allocate(testCtx(t, 30*time.Second), labels.MustParse("k8s:app=tls"))
	if err != nil || !allocated {
		t.Fatalf("allocation over TLS: %v %v", allocated, err)
	}
	if v, _, ok := getValue(t, c.Client(t), masterKey(id.ID)); !ok || v != "k8s:app=tls;" {
		t.Fatalf("master key over TLS: %q %v", v, ok)
	}
}

// startAuthNode starts a node that authenticates as user, with the
// password in a file as an operator gives it.
func startAuthNode(t *testing.T, c *etcdtest.Cluster, name, user, password string) *etcdNode {
	t.Helper()
	file := filepath.Join(t.TempDir(), "password")
	if err := os.WriteFile(file, []byte(password+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return startEtcdNode(t, c, name, func(kv *kvstore.Config, _ *storeConfig) {
		kv.KVStoreUsername = user
		kv.KVStorePasswordFile = file
	})
}

// TestEtcdAuth allocates and releases a global identity on an etcd with
// authentication on: the create transaction, built as protobuf messages,
// goes through the client's connection and so carries its token.
func TestEtcdAuth(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	c.EnableAuth(t, "s3cret")
	n1 := startAuthNode(t, c, "node1", "root", "s3cret")
	ctx := testCtx(t, 30*time.Second)
	l := labels.MustParse("k8s:app=auth")
	id, allocated, err := n1.alloc.Allocate(ctx, l)
	if err != nil || !allocated {
		t.Fatalf("allocation with auth: %v %v", allocated, err)
	}
	cli := c.Client(t)
	if v, _, ok := getValue(t, cli, masterKey(id.ID)); !ok || v != "k8s:app=auth;" {
		t.Fatalf("master key with auth: %q %v", v, ok)
	}
	if n := countKeys(t, cli, referencePrefix(l.Canonical())); n != 1 {
		t.Fatalf("%d reference keys, want 1", n)
	}
	if released, err := n1.alloc.Release(ctx, id); err != nil || !released {
		t.Fatalf("release with auth: %v %v", released, err)
	}
	if n := countKeys(t, cli, referencePrefix(l.Canonical())); n != 0 {
		t.Fatalf("%d reference keys after the release, want 0", n)
	}

	// Creations sharing a request pass the server's permission checks,
	// which look into nested transactions.
	var items []*createItem
	for i := range 3 {
		items = append(items, batchItem(t, n1.backend, labels.MustParse(fmt.Sprintf("k8s:app=auth%d", i)), identity.NumericIdentity(40000+i)))
	}
	sendAll(t, n1.backend.creates, items)
}

// A user whose role may only read and write the identities prefix, as an
// operator would give each agent, allocates and releases, alone and with
// creations sharing a request.
func TestEtcdAuthPrefixRole(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	c.EnableAuth(t, "s3cret")
	root := c.Client(t)
	ctx := testCtx(t, time.Minute)
	prefix := IdentitiesPrefix + "/"
	for _, step := range []func() error{
		func() error { _, err := root.RoleAdd(ctx, "identities"); return err },
		func() error {
			_, err := root.RoleGrantPermission(ctx, "identities", prefix, clientv3.GetPrefixRangeEnd(prefix), clientv3.PermissionType(clientv3.PermReadWrite))
			return err
		},
		func() error { _, err := root.UserAdd(ctx, "agent", "agent-pw"); return err },
		func() error { _, err := root.UserGrantRole(ctx, "agent", "identities"); return err },
	} {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
	n := startAuthNode(t, c, "node1", "agent", "agent-pw")

	const count = 24
	ids := make([]*identity.Identity, count)
	before := n.txns()
	var wg sync.WaitGroup
	for i := range count {
		wg.Go(func() {
			id, allocated, err := n.alloc.Allocate(ctx, labels.MustParse(fmt.Sprintf("k8s:app=role%d", i)))
			if err != nil || !allocated {
				t.Errorf("allocation %d with a prefix role: allocated %v, err %v", i, allocated, err)
			}
			ids[i] = id
		})
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	if got := n.txns() - before; got >= count {
		t.Fatalf("%d concurrent allocations in %d transactions: none shared a request", count, got)
	}
	if got := countKeys(t, root, MasterKeyPrefix); got != count {
		t.Fatalf("%d master keys, want %d", got, count)
	}
	for _, id := range ids {
		if released, err := n.alloc.Release(ctx, id); err != nil || !released {
			t.Fatalf("release with a prefix role: %v %v", released, err)
		}
	}
	if got := countKeys(t, root, ReferenceKeyPrefix); got != 0 {
		t.Fatalf("%d reference keys after the releases, want 0", got)
	}
	st := n.kv.Status(ctx)
	if st.Leader == "" || len(st.Endpoints) != 1 || st.Endpoints[0].Error != "" {
		t.Fatalf("status with a prefix role: %+v", st)
	}
}

// TestEtcdNotUsedInCRDMode: with --identity-allocation-mode=crd the store
// is not built even though the kvstore cell has an etcd client: global
// identities go to the crd driver, nothing is written to etcd (not even
// the node-name claim), and the module reports that it is not used.
func TestEtcdNotUsedInCRDMode(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	crd := allocatortest.NewStore(identity.ClusterInfo{Name: "default"})
	var (
		a    allocator.Allocator
		b    *Store
		kv   *kvstore.Client
		prov *health.Provider
	)
	opts := hive.DefaultOptions()
	opts.ModuleDecorators = health.ModuleDecorators
	h := hive.NewWithOptions(opts,
		health.Cell, statedir.Cell, job.Cell, statedb.Cell, kvstore.Cell, allocator.Cell, Cell,
		allocatortest.DriverCell(identity.AllocationModeCRD, crd.NewBackend("crd-node")),
		cell.Invoke(func(x allocator.Allocator, y *Store, z *kvstore.Client, p *health.Provider) {
			a, b, kv, prov = x, y, z, p
		}),
	)
	configureNode(t, h, c, "crd-node")
	hive.AddConfigOverride(h, func(cfg *allocator.Config) { cfg.IdentityAllocationMode = identity.AllocationModeCRD })
	log := nodeLogger(t)
	if err := h.Start(log, testCtx(t, time.Minute)); err != nil {
		t.Fatal(err)
	}
	defer h.Stop(log, context.Background())
	if b != nil {
		t.Fatal("crd mode built the etcd store")
	}
	if kv == nil {
		t.Fatal("crd mode with --kvstore-endpoints has no etcd client")
	}
	if _, _, err := a.Allocate(testCtx(t, time.Minute), labels.MustParse("k8s:app=crd")); err != nil {
		t.Fatal(err)
	}
	if crd.Len() != 1 {
		t.Fatalf("the crd driver's store holds %d identities, want 1", crd.Len())
	}
	resp, err := c.Client(t).Get(testCtx(t, time.Minute), IdentitiesPrefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		t.Fatal(err)
	}
	if resp.Count != 0 {
		t.Fatalf("%d keys under %s in crd mode, want none", resp.Count, IdentitiesPrefix)
	}
	const want = "Not used in crd mode: global identities are CiliumIdentity objects"
	for _, st := range prov.All() {
		if st.Name == "etcdstore" {
			if st.Message != want || !st.OK() {
				t.Fatalf("etcdstore health %+v, want OK %q", st, want)
			}
			return
		}
	}
	t.Fatalf("no etcdstore health scope in %+v", prov.All())
}

func TestEtcdNoKVStore(t *testing.T) {
	var a allocator.Allocator
	var b *Store
	h := hive.New(job.Cell, statedb.Cell, allocator.Cell, Cell, cell.Invoke(func(x allocator.Allocator, y *Store) { a, b = x, y }))
	if err := h.Start(hivetest.Logger(t), t.Context()); err != nil {
		t.Fatal(err)
	}
	defer h.Stop(hivetest.Logger(t), context.Background())
	if b != nil {
		t.Fatalf("backend without a kvstore: %v", b)
	}
	if _, _, err := a.Allocate(t.Context(), labels.MustParse("k8s:app=x")); !errors.Is(err, allocator.ErrNoGlobalBackend) {
		t.Fatalf("allocation without a kvstore: %v", err)
	}
}

// multiNode has three nodes allocate the same label sets at once and checks
// that etcd ends up exact: one ID per label set and one label set per ID,
// the same on every node, one reference key per node and label set.
func multiNode(t *testing.T, c *etcdtest.Cluster, sets int, during func()) {
	cli := c.Client(t)
	var nodes []*etcdNode
	for i := range 3 {
		nodes = append(nodes, startEtcdNode(t, c, "node"+strconv.Itoa(i)))
	}
	all := make([]labels.Labels, sets)
	for i := range all {
		all[i] = labels.MustParse("k8s:app=multi"+strconv.Itoa(i), "k8s:io.kubernetes.pod.namespace=ns"+strconv.Itoa(i%7))
	}
	ctx := testCtx(t, 5*time.Minute)
	got := make([][]identity.NumericIdentity, len(nodes))
	var wg sync.WaitGroup
	errs := make(chan error, len(nodes)*8)
	start := time.Now()
	for ni, n := range nodes {
		got[ni] = make([]identity.NumericIdentity, sets)
		for g := range 8 {
			wg.Go(func() {
				// Each node walks the sets in its own order so that
				// creations and adoptions interleave.
				for k := g; k < sets; k += 8 {
					i := (k + ni*sets/3) % sets
					var id *identity.Identity
					var err error
					for range 20 {
						if id, _, err = n.alloc.Allocate(ctx, all[i]); err == nil {
							break
						}
						time.Sleep(50 * time.Millisecond)
					}
					if err != nil {
						errs <- fmt.Errorf("%s: %s: %w", n.name, all[i], err)
						return
					}
					got[ni][i] = id.ID
				}
			})
		}
	}
	if during != nil {
		during()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	t.Logf("%d label sets on 3 nodes: %.0f identities/s", sets, float64(sets)/time.Since(start).Seconds())

	seen := map[identity.NumericIdentity]int{}
	for i := range all {
		if got[0][i] != got[1][i] || got[0][i] != got[2][i] {
			t.Fatalf("nodes disagree on %s: %d %d %d", all[i], got[0][i], got[1][i], got[2][i])
		}
		if j, dup := seen[got[0][i]]; dup {
			t.Fatalf("ID %d has two label sets: %s and %s", got[0][i], all[j], all[i])
		}
		seen[got[0][i]] = i
	}
	if n := countKeys(t, cli, MasterKeyPrefix); n != int64(sets) {
		t.Fatalf("%d master keys, want %d", n, sets)
	}
	if n := countKeys(t, cli, ReferenceKeyPrefix); n != int64(3*sets) {
		t.Fatalf("%d reference keys, want %d", n, 3*sets)
	}
	resp, err := cli.Get(ctx, MasterKeyPrefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	for _, kv := range resp.Kvs {
		id, _ := identity.ParseNumericIdentity(strings.TrimPrefix(string(kv.Key), MasterKeyPrefix))
		i, ok := seen[id]
		if !ok || all[i].Canonical() != string(kv.Value) {
			t.Fatalf("master key %s = %s, allocated to nothing or to another label set", kv.Key, kv.Value)
		}
	}
	for _, n := range nodes {
		eventually.True(t, n.name+"'s cache has every identity", func() bool {
			for i := range all {
				if id, ok := n.backend.LookupByLabels(all[i]); !ok || id != got[0][i] {
					return false
				}
			}
			return true
		})
	}
}

func multiNodeSets(t *testing.T) int {
	if testing.Short() {
		return 200
	}
	return 2000
}

func TestEtcdMultiNode(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	multiNode(t, c, multiNodeSets(t), nil)
}

func TestEtcdMultiNodeMemberRestart(t *testing.T) {
	c := etcdtest.StartCluster(t, 3, etcdtest.WithUnsafeNoFsync())
	multiNode(t, c, multiNodeSets(t), func() {
		time.Sleep(300 * time.Millisecond)
		m := c.Member(c.Leader(t))
		m.Kill()
		time.Sleep(time.Second)
		m.Restart()
	})
	c.WaitLeader(t)
}
