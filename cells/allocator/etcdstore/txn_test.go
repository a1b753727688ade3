package etcdstore

import (
	"context"
	"testing"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

// txnCapture is a KV client that records the transaction it is sent.
type txnCapture struct {
	pb.KVClient
	req *pb.TxnRequest
}

func (c *txnCapture) Txn(_ context.Context, req *pb.TxnRequest, _ ...grpc.CallOption) (*pb.TxnResponse, error) {
	c.req = req
	return &pb.TxnResponse{}, nil
}

// TestCreateTxnMatchesClientBuilder checks the hand-built create
// transaction against the same transaction built with clientv3's Txn
// builder, message for message.
func TestCreateTxnMatchesClientBuilder(t *testing.T) {
	for _, tc := range []struct{ master, refs, locks, node, value, id string }{
		{masterKey(1234), referencePrefix("k8s:app=web;"), lockPrefix("k8s:app=web;"), "node-1", "k8s:app=web;", "1234"},
		{"a", "b/", "c\xff", "n", "", "7"},
		{"m", "\xff\xff", "l\x01\xff", "x", "v", "9"},
	} {
		capture := &txnCapture{}
		_, err := clientv3.NewKVFromKVClient(capture, nil).Txn(context.Background()).If(
			clientv3.Compare(clientv3.CreateRevision(tc.master), "=", 0),
			clientv3.Compare(clientv3.CreateRevision(tc.refs), "=", 0).WithPrefix(),
			clientv3.Compare(clientv3.CreateRevision(tc.locks), "=", 0).WithPrefix(),
		).Then(
			clientv3.OpPut(tc.master, tc.value),
			clientv3.OpPut(tc.refs+tc.node, tc.id, clientv3.WithLease(42)),
		).Else(
			clientv3.OpGet(tc.master),
			clientv3.OpGet(tc.refs, clientv3.WithPrefix(), clientv3.WithLimit(1)),
		).Commit()
		if err != nil {
			t.Fatal(err)
		}
		got := createTxn(tc.master, tc.refs, tc.locks, tc.node, tc.value, tc.id, 42, 0)
		if !proto.Equal(got, capture.req) {
			t.Errorf("createTxn(%q, ...):\n got %v\nwant %v", tc.master, got, capture.req)
		}
	}
}
