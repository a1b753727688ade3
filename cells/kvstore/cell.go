package kvstore

import (
	"fmt"

	"github.com/cilium/hive/cell"

	"github.com/identityd/identityd/identity"
)

// Cell provides *Client: the etcd client, connected to --kvstore-endpoints
// or to an embedded etcd in <state-dir>/etcd, the kvstore/status command and
// this node's validated --node-name as an identity.NodeName. With
// --identity-allocation-mode=crd and no --kvstore-endpoints the *Client is
// nil: no embedded etcd, nothing in <state-dir>/etcd, nothing listening.
var Cell = cell.Module(
	"kvstore",
	"etcd client and embedded etcd",

	cell.Config(DefaultConfig),
	cell.Provide(
		newClient,
		nodeName,
		scriptCommands,
		newClientMetrics,
	),
	// Refuses an invalid configuration (a bad --node-name, say) in this
	// module's own invoke, which hive's log then names, rather than in a
	// constructor: those run inside whichever invoke first needs them,
	// often another module's (the metrics registry's gathers every
	// cell's collector), and the log would blame that module.
	cell.Invoke(checkConfig),
)

type nodeNameParams struct {
	cell.In

	Config Config
	// Mode is the configured --identity-allocation-mode (the allocator
	// cell provides it); the modes that use CRDs ask more of the name.
	Mode identity.AllocationMode `optional:"true"`
}

// nodeName gives the stores this node's name without their importing this
// cell. checkConfig refuses an invalid one before anything starts.
func nodeName(p nodeNameParams) identity.NodeName {
	return identity.NodeName(p.Config.nodeName())
}

// checkConfig refuses the configuration of the client and of the node
// name, which the modes that use CRDs ask more of.
func checkConfig(p nodeNameParams) error {
	if err := p.Config.Validate(); err != nil {
		return fmt.Errorf("kvstore: %w", err)
	}
	if p.Mode.UsesCRD() {
		if err := ValidateObjectNodeName(p.Config.nodeName()); err != nil {
			return fmt.Errorf("kvstore: %w", err)
		}
	}
	return nil
}
