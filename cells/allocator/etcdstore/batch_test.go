package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/identityd/identityd/internal/eventually"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/labels"
)

// batchItem builds the create transaction node b would send for lbls with
// candidate ID id.
func batchItem(tb testing.TB, b *Store, lbls labels.Labels, id identity.NumericIdentity) *createItem {
	tb.Helper()
	lease, err := b.kv.Lease(testCtx(tb, 10*time.Second))
	if err != nil {
		tb.Fatal(err)
	}
	key := lbls.Canonical()
	master, refs := masterKey(id), referencePrefix(key)
	return &createItem{
		cli:    b.kv.Client(),
		req:    createTxn(master, refs, lockPrefix(key), b.node, key, id.String(), lease, 0),
		master: master,
		ref:    refs + b.node,
		done:   make(chan struct{}),
	}
}

// sendAll sends items in one request and fails the test unless every one
// succeeded.
func sendAll(tb testing.TB, q *createBatcher, items []*createItem) {
	tb.Helper()
	q.send(items)
	for _, it := range items {
		<-it.done
		if it.err != nil || !it.resp.Succeeded {
			tb.Fatalf("%s: succeeded %v, err %v", it.master, it.resp.GetSucceeded(), it.err)
		}
	}
}

// blockCreates fills the batcher's places in flight, so that every create
// queues until unblockCreates.
func blockCreates(q *createBatcher) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.inFlight, q.inFlightItems = createsInFlight, 1<<20
}

func unblockCreates(q *createBatcher) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.inFlight, q.inFlightItems = 0, 0
	q.sendQueued()
}

func queued(q *createBatcher) int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.queue)
}

// Create transactions sent in one request keep their own compares and
// failure reads: one succeeds while the two others fail for their own
// reasons, and each learns why.
func TestCreateBatchNestedOutcomes(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	n1 := startEtcdNode(t, c, "node1")
	n2 := startEtcdNode(t, c, "node2")
	ctx := testCtx(t, time.Minute)

	taken := labels.MustParse("k8s:app=taken")
	other, _, err := n2.alloc.Allocate(ctx, taken)
	if err != nil {
		t.Fatal(err)
	}
	fresh := labels.MustParse("k8s:app=fresh")
	newSet := labels.MustParse("k8s:app=new")
	created := batchItem(t, n1.backend, newSet, 60001)
	referenced := batchItem(t, n1.backend, taken, 60002) // node2 references the label set
	idTaken := batchItem(t, n1.backend, fresh, other.ID) // the ID has a master key

	before := n1.txns()
	n1.backend.creates.send([]*createItem{created, referenced, idTaken})
	if got := n1.txns() - before; got != 1 {
		t.Fatalf("three creates cost %d transactions, want 1", got)
	}
	for _, it := range []*createItem{created, referenced, idTaken} {
		<-it.done
		if it.err != nil {
			t.Fatalf("%s: %v", it.master, it.err)
		}
	}

	if !created.resp.Succeeded {
		t.Fatal("the create of a new label set with a free ID failed")
	}
	rev := created.resp.Header.GetRevision()
	resp, err := cli.Get(ctx, masterKey(60001))
	if err != nil || len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != newSet.Canonical() || resp.Kvs[0].ModRevision != rev {
		t.Fatalf("master key of the created identity: %v %v (response revision %d)", resp, err, rev)
	}
	if v, lease, ok := getValue(t, cli, refKey(newSet, "node1")); !ok || v != "60001" || lease == 0 {
		t.Fatalf("reference key of the created identity = %q lease %x %v", v, lease, ok)
	}

	if referenced.resp.Succeeded {
		t.Fatal("the create of a label set node2 references succeeded")
	}
	refs := referenced.resp.Responses[1].GetResponseRange().GetKvs()
	if len(refs) != 1 || string(refs[0].Key) != refKey(taken, "node2") || string(refs[0].Value) != other.ID.String() {
		t.Fatalf("failure read of the references = %v, want node2's reference to %d", refs, other.ID)
	}
	if _, _, ok := getValue(t, cli, masterKey(60002)); ok {
		t.Fatal("the failed create wrote its master key")
	}

	if idTaken.resp.Succeeded {
		t.Fatal("the create with a taken ID succeeded")
	}
	masters := idTaken.resp.Responses[0].GetResponseRange().GetKvs()
	if len(masters) != 1 || string(masters[0].Value) != taken.Canonical() {
		t.Fatalf("failure read of the master key = %v, want %q", masters, taken.Canonical())
	}
	if _, _, ok := getValue(t, cli, refKey(fresh, "node1")); ok {
		t.Fatal("the failed create wrote its reference key")
	}
}

// Allocations running at once share requests, and each gets its own
// identity with both keys written.
func TestEtcdConcurrentCreatesShareRequests(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	n := startEtcdNode(t, c, "node1")
	ctx := testCtx(t, time.Minute)

	const goroutines, each = 32, 4
	ids := make([][]*identity.Identity, goroutines)
	before := n.txns()
	var start, wg sync.WaitGroup
	start.Add(1)
	for g := range goroutines {
		wg.Go(func() {
			start.Wait()
			for i := range each {
				id, allocated, err := n.alloc.Allocate(ctx, labels.MustParse(fmt.Sprintf("k8s:app=c%d-%d", g, i)))
				if err != nil || !allocated {
					t.Errorf("allocation %d/%d: allocated %v, err %v", g, i, allocated, err)
					return
				}
				ids[g] = append(ids[g], id)
			}
		})
	}
	start.Done()
	wg.Wait()
	if t.Failed() {
		return
	}
	txns := n.txns() - before
	if txns >= goroutines*each {
		t.Fatalf("%d concurrent allocations cost %d transactions: none shared a request", goroutines*each, txns)
	}
	t.Logf("%d allocations in %d requests", goroutines*each, txns)

	seen := map[identity.NumericIdentity]string{}
	for _, list := range ids {
		for _, id := range list {
			key := id.Labels.Canonical()
			if prev, dup := seen[id.ID]; dup {
				t.Fatalf("ID %d given to %s and %s", id.ID, prev, key)
			}
			seen[id.ID] = key
			if v, _, ok := getValue(t, cli, masterKey(id.ID)); !ok || v != key {
				t.Fatalf("master key %d = %q %v, want %q", id.ID, v, ok, key)
			}
			if v, _, ok := getValue(t, cli, refKey(id.Labels, "node1")); !ok || v != id.ID.String() {
				t.Fatalf("reference key of %s = %q %v, want %d", key, v, ok, id.ID)
			}
		}
	}
	if got := countKeys(t, cli, MasterKeyPrefix); got != goroutines*each {
		t.Fatalf("%d master keys, want %d", got, goroutines*each)
	}
}

// A caller that gives up while its create waits in the queue takes it out
// and gets its candidate ID back; one that gives up while the request is in
// flight leaves the outcome to the batcher, which deletes the reference it
// wrote, so no reference outlives the caller.
func TestEtcdAbandonedCreates(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	n := startEtcdNode(t, c, "node1")
	b, q := n.backend, n.backend.creates
	ctx := testCtx(t, time.Minute)

	allocate := func(ctx context.Context, lbls labels.Labels) <-chan error {
		done := make(chan error, 1)
		go func() {
			_, _, err := b.Allocate(ctx, lbls, unrecorded)
			done <- err
		}()
		return done
	}

	// Given up while queued.
	available := b.pool.Available()
	blockCreates(q)
	qctx, qcancel := context.WithCancel(ctx)
	done := allocate(qctx, labels.MustParse("k8s:app=queued"))
	eventually.True(t, "the create queues", func() bool { return queued(q) == 1 })
	qcancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("abandoned queued allocation: %v, want context.Canceled", err)
	}
	if got := queued(q); got != 0 {
		t.Fatalf("%d creates still queued", got)
	}
	if got := b.pool.Available(); got != available {
		t.Fatalf("pool has %d IDs available, had %d: the abandoned create kept its ID", got, available)
	}

	// Given up while in flight: the server is stopped, so the request
	// waits there until the caller has gone.
	inFlight := labels.MustParse("k8s:app=in-flight")
	fctx, fcancel := context.WithCancel(ctx)
	done = allocate(fctx, inFlight)
	eventually.True(t, "the create queues", func() bool { return queued(q) == 1 })
	c.Member(0).Pause()
	unblockCreates(q)
	fcancel()
	err := <-done
	c.Member(0).Resume()
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("abandoned allocation in flight: %v, want context.Canceled", err)
	}

	var id identity.NumericIdentity
	eventually.True(t, "the abandoned create's master key appears", func() bool {
		resp, err := cli.Get(ctx, MasterKeyPrefix, clientv3.WithPrefix())
		if err != nil {
			return false
		}
		for _, kv := range resp.Kvs {
			if string(kv.Value) == inFlight.Canonical() {
				id, err = identity.ParseNumericIdentity(string(kv.Key[len(MasterKeyPrefix):]))
				return err == nil
			}
		}
		return false
	})
	eventually.True(t, "the abandoned create's reference is deleted", func() bool {
		_, _, ok := getValue(t, cli, refKey(inFlight, "node1"))
		return !ok
	})
	if _, held := b.heldLabelSets()[inFlight.Canonical()]; held {
		t.Fatal("the backend holds the abandoned label set")
	}

	// The label set's master key is unused now: the next allocation
	// takes it over.
	got, _, err := b.Allocate(ctx, inFlight, unrecorded)
	if err != nil || got != id {
		t.Fatalf("allocating the abandoned label set again: %d %v, want %d", got, err, id)
	}
	if v, _, ok := getValue(t, cli, refKey(inFlight, "node1")); !ok || v != id.String() {
		t.Fatalf("reference key = %q %v, want %d", v, ok, id)
	}
}

// A server that allows fewer operations per transaction than a request of
// creates holds makes the batcher split it, and send smaller requests from
// then on.
func TestCreateBatchTooManyOps(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync(), etcdtest.WithServerArgs("--max-txn-ops=8"))
	cli := c.Client(t)
	n := startEtcdNode(t, c, "node1")

	var items []*createItem
	for i := range 12 {
		items = append(items, batchItem(t, n.backend, labels.MustParse(fmt.Sprintf("k8s:app=ops%d", i)), identity.NumericIdentity(50000+i)))
	}
	sendAll(t, n.backend.creates, items)
	// A nested transaction's operations count against the limit together
	// with its parent's: 3 creates of 3 compares each fit in 8.
	if got := n.backend.creates.maxBatch.Load(); got != 3 {
		t.Fatalf("batch limit after the refusals = %d, want 3", got)
	}
	if got := countKeys(t, cli, MasterKeyPrefix); got != 12 {
		t.Fatalf("%d master keys, want 12", got)
	}
}

// When the backend stops, a create still waiting in the queue is answered
// at once, and no create is sent afterwards.
func TestEtcdCreatesAfterStop(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	n := startEtcdNode(t, c, "node1")
	b, q := n.backend, n.backend.creates
	ctx := testCtx(t, time.Minute)

	available := b.pool.Available()
	blockCreates(q)
	done := make(chan error, 1)
	go func() {
		_, _, err := b.Allocate(ctx, labels.MustParse("k8s:app=waiting"), unrecorded)
		done <- err
	}()
	eventually.True(t, "the create queues", func() bool { return queued(q) == 1 })
	q.stop()
	if err := <-done; !errors.Is(err, kvstore.ErrStopped) {
		t.Fatalf("queued allocation at stop: %v, want kvstore.ErrStopped", err)
	}
	unblockCreates(q)
	before := n.txns()
	if _, _, err := b.Allocate(ctx, labels.MustParse("k8s:app=late"), unrecorded); !errors.Is(err, kvstore.ErrStopped) {
		t.Fatalf("allocation after the stop: %v, want kvstore.ErrStopped", err)
	}
	if got := n.txns() - before; got != 0 {
		t.Fatalf("%d transactions sent after the stop", got)
	}
	if got := b.pool.Available(); got != available {
		t.Fatalf("pool has %d IDs available, had %d", got, available)
	}
}

// unrecorded is the record of an allocation a test makes through the store
// alone, past the allocator: the allocator does not hold it.
func unrecorded(*globalstore.Reference) {}
