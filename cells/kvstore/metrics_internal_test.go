package kvstore

import (
	"testing"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
)

func TestKeyScope(t *testing.T) {
	for _, tc := range []struct {
		req  any
		want string
	}{
		{&pb.RangeRequest{Key: []byte("cilium/state/identities/v1/id/1000")}, "cilium/state/identities"},
		{&pb.PutRequest{Key: []byte("cilium/state/identities")}, "cilium/state/identities"},
		{&pb.DeleteRangeRequest{Key: []byte("a/b")}, "a/b"},
		{&pb.RangeRequest{Key: []byte("a/b/c/")}, "a/b/c"},
		{&pb.RangeRequest{Key: []byte("/x/y/z")}, "/x/y"},
		{&pb.TxnRequest{Compare: []*pb.Compare{{Key: []byte("p/q/r/s")}}}, "p/q/r"},
		{&pb.TxnRequest{Success: []*pb.RequestOp{{Request: &pb.RequestOp_RequestPut{RequestPut: &pb.PutRequest{Key: []byte("u/v/w/x")}}}}}, "u/v/w"},
		{&pb.TxnRequest{}, ""},
		{&pb.LeaseGrantRequest{}, ""},
	} {
		if got := string(keyScope(tc.req)); got != tc.want {
			t.Errorf("keyScope(%v) = %q, want %q", tc.req, got, tc.want)
		}
	}
}

func TestRequestMetricsCachesObservers(t *testing.T) {
	m := newRequestMetrics()
	a := m.observer("/etcdserverpb.KV/Txn", []byte("cilium/state/identities"))
	b := m.observer("/etcdserverpb.KV/Txn", []byte("cilium/state/identities"))
	c := m.observer("/etcdserverpb.KV/Range", []byte("cilium/state/identities"))
	if a != b {
		t.Error("the same method and scope got two observer pairs")
	}
	if a == c {
		t.Error("two methods share an observer pair")
	}
}
