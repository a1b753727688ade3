package kvstore

import "github.com/cilium/hive/cell"

// Cell provides *Client: the etcd client, connected to --kvstore-endpoints
// or to an embedded etcd in <state-dir>/etcd, and the kvstore/status
// command.
var Cell = cell.Module(
	"kvstore",
	"etcd client and embedded etcd",

	cell.Config(DefaultConfig),
	cell.Provide(
		newClient,
		scriptCommands,
		newClientMetrics,
	),
)
