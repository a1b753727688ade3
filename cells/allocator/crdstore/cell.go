package crdstore

import (
	"log/slog"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"k8s.io/client-go/rest"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/identity"
)

// Cell provides the globalstore.Backend that keeps global identities as
// CiliumIdentity objects in a Kubernetes API server, when the hive has a
// *rest.Config; without one it provides none. It takes the cluster's ID
// range as an identity.ClusterInfo and this node's name as an
// identity.NodeName, and registers --identity-node-lease-ttl. Its loops are
// jobs of this module: the watches of CiliumIdentity and IdentityNode
// objects, the IdentityNode writer and its renewal, and the removal of
// heartbeat marks from identities this node uses.
var Cell = cell.Module(
	"crdstore",
	"Global identities in Kubernetes CRD objects",

	cell.Config(DefaultConfig),
	cell.Provide(newBackend, newStoreMetrics),
)

type params struct {
	cell.In

	RESTConfig *rest.Config `optional:"true"`
	Cluster    identity.ClusterInfo
	Node       identity.NodeName `optional:"true"`
	Config     Config
	Log        *slog.Logger
	Jobs       job.Registry
	Health     cell.Health `optional:"true"`
}

// newBackend provides the store when the hive has a REST config, and a nil
// interface (no global backend) without one.
func newBackend(p params) (globalstore.Backend, error) {
	if p.RESTConfig == nil {
		if p.Health != nil {
			p.Health.OK("No Kubernetes client in the hive: no CRD identities")
		}
		return nil, nil
	}
	h := health.OrDetached(p.Health)
	s, err := New(p.Log, p.RESTConfig, p.Cluster, p.Node, p.Config, p.Jobs.NewGroup(h))
	if err != nil {
		return nil, err
	}
	return s, nil
}
