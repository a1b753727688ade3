package kvstore_test

import (
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/internal/etcdtest"
)

// TestGrantedRemembersLastLeases: Granted knows the client's last 8
// leases, not older ones, nor a lease another client granted.
func TestGrantedRemembersLastLeases(t *testing.T) {
	t.Parallel()
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	c := startNode(t, etcd, nil).client
	var leases []clientv3.LeaseID
	for range 9 {
		l, err := c.Lease(ctxT(t))
		if err != nil {
			t.Fatal(err)
		}
		leases = append(leases, l)
		if err := c.RevokeLease(ctxT(t)); err != nil {
			t.Fatal(err)
		}
	}
	if c.Granted(leases[0]) {
		t.Error("the ninth lease back is still known as granted")
	}
	for _, l := range leases[1:] {
		if !c.Granted(l) {
			t.Errorf("lease %x, one of the last 8, not known as granted", l)
		}
	}
	other, err := etcd.Client(t).Grant(ctxT(t), 60)
	if err != nil {
		t.Fatal(err)
	}
	if c.Granted(other.ID) || c.Granted(0) {
		t.Error("a lease of another client, or none, known as granted")
	}
}
