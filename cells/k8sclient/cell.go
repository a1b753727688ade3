package k8sclient

import "github.com/cilium/hive/cell"

// Cell provides *Client, the Kubernetes API client, in crd allocation mode
// or when --k8s-kubeconfig-path or --k8s-api-server is set (nil
// otherwise), its metrics and the k8s/status command.
var Cell = cell.Module(
	"k8s-client",
	"Kubernetes API client",

	cell.Config(DefaultConfig),
	cell.Provide(
		newClient,
		scriptCommands,
		newClientMetrics,
	),
)
