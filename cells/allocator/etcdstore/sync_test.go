package etcdstore

import (
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/labels"
)

// TestEtcdPeriodicSyncBatches: the periodic sync of a node holding 100
// references costs two transactions (a batch of 64 keys each at most) and
// no read while nothing changed, rather than one read per reference; a
// deleted reference in a batch is still found and written again.
func TestEtcdPeriodicSyncBatches(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	n := startEtcdNode(t, c, "node1")
	ctx := testCtx(t, time.Minute)
	var first labels.Labels
	for i := range 100 {
		lbls := labels.MustParse(fmt.Sprintf("k8s:app=sync-%d", i))
		if _, _, err := n.alloc.Allocate(ctx, lbls); err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			first = lbls
		}
	}
	keyBytes := 0
	for i := range 100 {
		keyBytes += len(refKey(labels.MustParse(fmt.Sprintf("k8s:app=sync-%d", i)), "node1"))
	}
	before, receivedBefore := n.kv.RequestCounts(), receivedBytes(t, c)
	if rewritten, err := n.backend.syncReferences(ctx); err != nil || rewritten != 0 {
		t.Fatalf("sync: %d rewritten, %v", rewritten, err)
	}
	after, received := n.kv.RequestCounts(), receivedBytes(t, c)-receivedBefore
	// The node-name check reads one key; the references cost no read.
	if txns, ranges := after["Txn"]-before["Txn"], after["Range"]-before["Range"]; txns != 2 || ranges > 1 {
		t.Errorf("a sync of 100 unchanged references sent %d transactions and %d reads, want 2 and at most 1", txns, ranges)
	}
	// Every node sends this every period: each key once, in its compare.
	if received > keyBytes*3/2 {
		t.Errorf("etcd received %d bytes for a sync of 100 unchanged references of %d key bytes in all; want each key sent once", received, keyBytes)
	}

	if _, err := cli.Delete(ctx, refKey(first, "node1")); err != nil {
		t.Fatal(err)
	}
	if rewritten, err := n.backend.syncReferences(ctx); err != nil || rewritten != 1 {
		t.Fatalf("sync after a deleted reference: %d rewritten, %v; want 1", rewritten, err)
	}
	if _, _, ok := getValue(t, cli, refKey(first, "node1")); !ok {
		t.Error("the deleted reference was not written again")
	}
}

// receivedBytes is what etcd counts of the gRPC messages its clients sent.
func receivedBytes(t *testing.T, c *etcdtest.Cluster) int {
	t.Helper()
	resp, err := http.Get(c.Endpoints()[0] + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(body)) {
		if v, ok := strings.CutPrefix(line, "etcd_network_client_grpc_received_bytes_total "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				t.Fatal(err)
			}
			return int(f)
		}
	}
	t.Fatal("etcd's /metrics has no etcd_network_client_grpc_received_bytes_total")
	return 0
}
