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
)

type nodeNameParams struct {
	cell.In

	Config Config
	// Mode is the configured --identity-allocation-mode (the allocator
	// cell provides it); the modes that use CRDs ask more of the name.
	Mode identity.AllocationMode `optional:"true"`
}

// nodeName gives the stores this node's name without their importing this
// cell.
func nodeName(p nodeNameParams) (identity.NodeName, error) {
	validate := ValidateNodeName
	if p.Mode.UsesCRD() {
		validate = ValidateObjectNodeName
	}
	name := p.Config.nodeName()
	if err := validate(name); err != nil {
		return "", fmt.Errorf("kvstore: %w", err)
	}
	return identity.NodeName(name), nil
}
