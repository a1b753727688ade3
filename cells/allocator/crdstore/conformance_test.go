package crdstore

import (
	"testing"

	"github.com/cilium/hive/cell"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/allocator/globalstore/storetest"
	"github.com/identityd/identityd/identity"
)

// TestConformance runs the contract of global stores on the CRD store,
// each node in a hive of its own, on one API server, collecting with a
// heartbeat timeout of a second.
func TestConformance(t *testing.T) {
	srv := serialServer(t)
	storetest.Run(t, storetest.Harness{
		Mode:    identity.AllocationModeCRD,
		Cluster: gcCluster,
		Start: func(t *testing.T, name string, cells ...cell.Cell) (globalstore.Backend, func()) {
			// The suite's cells bind the node's Sink after newGCNode's.
			n := newGCNode(t, srv.RESTConfig(), name, gcTestConfig, cells...)
			n.start(t)
			return n.Store, func() {
				if err := n.stop(); err != nil {
					t.Error(err)
				}
			}
		},
		Collect: func(t *testing.T, b globalstore.Backend) {
			if _, err := b.(*Store).collect(t.Context()); err != nil {
				t.Fatal(err)
			}
		},
	})
}
