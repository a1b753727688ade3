package etcdstore

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/labels"
)

// cacheRecorder collects what a masterCache reports.
type cacheRecorder struct{ changes []change }

func (r *cacheRecorder) take() []change {
	out := r.changes
	r.changes = nil
	return out
}

func masterPut(id identity.NumericIdentity, value string, rev int64) *clientv3.Event {
	return &clientv3.Event{Type: mvccpb.PUT, Kv: &mvccpb.KeyValue{
		Key: []byte(masterKey(id)), Value: []byte(value), ModRevision: rev,
	}}
}

// TestMasterCacheCreatedEntries checks the entries a node's own
// transactions put into the cache before the watch reports them: they are
// not reported (the allocator reports them itself), the watch event of the
// same write neither, a listing older than the write keeps them, a newer
// one without them removes them, and a write the cache has seen already is
// not stored again.
func TestMasterCacheCreatedEntries(t *testing.T) {
	rec := &cacheRecorder{}
	c := newMasterCache(slog.New(slog.DiscardHandler), nil, "test identities", cacheHooks{
		emit: func(ch []change) { rec.changes = append(rec.changes, ch...) },
	})
	empty := func() map[identity.NumericIdentity]*masterEntry { return map[identity.NumericIdentity]*masterEntry{} }
	c.replace(empty(), map[string]string{}, 10)

	const id = identity.NumericIdentity(300)
	lbls := labels.MustParse("k8s:app=web")
	key := lbls.Canonical()
	c.insertCreated(id, key, lbls, 11)
	if got, ok := c.cachedID(key); !ok || got != id {
		t.Fatalf("created entry not visible at once: %d %v", got, ok)
	}
	if got, ok := c.lookupLabels(id); !ok || !got.Equal(lbls) {
		t.Fatalf("lookupLabels(%d) = %v %v", id, got, ok)
	}
	if ch := rec.take(); len(ch) != 0 {
		t.Fatalf("created entry reported: %+v", ch)
	}

	// The watch event of the same write.
	c.apply([]*clientv3.Event{masterPut(id, key, 11)})
	if ch := rec.take(); len(ch) != 0 {
		t.Fatalf("watch echo of a created entry reported: %+v", ch)
	}

	// A listing read before the write cannot see it: the entry stays.
	c.replace(empty(), map[string]string{}, 10)
	if _, ok := c.cachedID(key); !ok {
		t.Fatal("listing older than the creation dropped the entry")
	}
	if ch := rec.take(); len(ch) != 0 {
		t.Fatalf("older listing reported changes: %+v", ch)
	}

	// A listing after the write that does not have it: the key is gone.
	c.replace(empty(), map[string]string{}, 12)
	if _, ok := c.cachedID(key); ok {
		t.Fatal("listing newer than the creation kept a deleted entry")
	}
	if ch := rec.take(); len(ch) != 1 || ch[0].upsert || ch[0].id != id {
		t.Fatalf("deletion not reported once: %+v", ch)
	}

	// A creation at a revision the cache has passed is left to the
	// watch, which reported it (and maybe its deletion) already.
	c.insertCreated(id, key, lbls, 12)
	if _, ok := c.cachedID(key); ok {
		t.Fatal("creation older than the cache's revision was stored")
	}

	// Another label set under a known ID is still a change.
	c.apply([]*clientv3.Event{masterPut(id, key, 13)})
	other := labels.MustParse("k8s:app=db")
	c.apply([]*clientv3.Event{masterPut(id, other.Canonical(), 14)})
	ch := rec.take()
	if len(ch) != 3 || !ch[0].upsert || ch[1].upsert || !ch[2].upsert || !ch[2].lbls.Equal(other) {
		t.Fatalf("changes = %+v, want upsert, delete, upsert of the new set", ch)
	}
	if got, _ := c.lookupLabels(id); !got.Equal(other) {
		t.Fatalf("cache has %v for %d, want %v", got, id, other)
	}
}

// TestListPrefixPages lists more keys than fit a page: every key comes
// once, in key order, and a key written while the listing runs is not in
// it, because every page reads the first page's revision.
func TestListPrefixPages(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	ctx := t.Context()
	const prefix = "test/list/"
	n := 2*listPageSize + 7
	for i := 0; i < n; i += 100 {
		var ops []clientv3.Op
		for j := i; j < min(i+100, n); j++ {
			ops = append(ops, clientv3.OpPut(fmt.Sprintf("%s%05d", prefix, j), "v"))
		}
		if _, err := cli.Txn(ctx).Then(ops...).Commit(); err != nil {
			t.Fatal(err)
		}
	}
	var keys []string
	noBound := func(ctx context.Context) (context.Context, context.CancelFunc) { return context.WithCancel(ctx) }
	rev, err := listPrefix(ctx, cli, prefix, noBound, func(kv *mvccpb.KeyValue) {
		if len(keys) == 0 {
			if _, err := cli.Put(ctx, prefix+"99999", "late"); err != nil {
				t.Error(err)
			}
		}
		keys = append(keys, string(kv.Key))
	}, clientv3.WithKeysOnly())
	if err != nil {
		t.Fatal(err)
	}
	if len(keys) != n {
		t.Fatalf("listed %d keys, want %d", len(keys), n)
	}
	for i, k := range keys {
		if want := fmt.Sprintf("%s%05d", prefix, i); k != want {
			t.Fatalf("key %d is %s, want %s", i, k, want)
		}
	}
	if resp, err := cli.Get(ctx, prefix+"99999"); err != nil || len(resp.Kvs) != 1 || resp.Kvs[0].ModRevision <= rev {
		t.Fatalf("the late key (%v, %v) was not written after the listing's revision %d", resp, err, rev)
	}
}

// TestRejectedMasterKeyLogCapped: a hostile master key (here a 200 KB
// value) is rejected with a log line of bounded length, not one that holds
// the whole value.
func TestRejectedMasterKeyLogCapped(t *testing.T) {
	var out bytes.Buffer
	c := newMasterCache(slog.New(slog.NewTextHandler(&out, nil)), nil, "test identities", cacheHooks{})
	hostile := "k8s:app=" + strings.Repeat("x", 200_000)
	c.apply([]*clientv3.Event{masterPut(identity.NumericIdentity(12345), hostile+"\x00;", 7)})
	line := out.String()
	if !strings.Contains(line, "Rejecting master key") {
		t.Fatalf("no rejection logged: %.300q", line)
	}
	if len(line) > 4096 {
		t.Errorf("the rejection's log line is %d bytes long", len(line))
	}
	if got := c.rejectedTotal.Load(); got != 1 {
		t.Errorf("rejected total %d, want 1", got)
	}
}
