package main

import (
	"slices"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/clustermesh"
	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/cells/allocator/doublewrite"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/cells/checkpoint"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/cells/k8sclient"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/cells/restoration"
	"github.com/identityd/identityd/cells/shell"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/cells/workloads"
	"github.com/identityd/identityd/identity"
)

// agentCells are the cells of the identityd agent, in the order of
// DESIGN.md's flow; hive orders their start hooks by dependency.
var agentCells = []cell.Cell{
	health.Cell,
	metrics.Cell,
	job.Cell,
	statedb.Cell,
	statedir.Cell,
	shell.Cell,
	kvstore.Cell,
	k8sclient.Cell,
	allocator.Cell,
	etcdstore.Cell,
	crdstore.Cell,
	doublewrite.Cell,
	clustermesh.Cell,
	checkpoint.Cell,
	ipcache.Cell,
	restoration.Cell,
	workloads.Cell,
	// Restored state waits longer for its users when they get it from
	// external kvstore endpoints, or from a Kubernetes API server in crd
	// mode (where the client may be nil). The client, not only its config,
	// keeps the kvstore constructed before restoration, as it has always
	// been.
	cell.Provide(func(mode identity.AllocationMode, c *kvstore.Client) restoration.AutomaticGracePeriod {
		return restoration.AutomaticGracePeriodFor(mode.UsesCRD() || !c.Embedded())
	}),

	// The agent exists to serve its cells; force the ones nothing else
	// depends on to be constructed.
	cell.Invoke(func(allocator.Allocator, *checkpoint.Checkpoint, *kvstore.Client, *ipcache.IPCache, *restoration.Restorer, *workloads.Workloads) {
	}),
}

// newHive returns the agent's hive. Every call builds a fresh one, so tests
// can run several agents in one process.
func newHive(extra ...cell.Cell) *hive.Hive {
	return hive.NewWithOptions(agentOptions(), append(slices.Clone(agentCells), extra...)...)
}

// EnvPrefix is the prefix of the environment variables that set the
// agent's flags: IDENTITYD_NODE_NAME sets --node-name. Without a prefix,
// hive would read NODE_NAME, STATE_DIR and the like, which other programs
// on a host or in a pod set for their own purposes.
const EnvPrefix = "IDENTITYD_"

// agentOptions are the hive options of the agent.
func agentOptions() hive.Options {
	opts := hive.DefaultOptions()
	opts.EnvPrefix = EnvPrefix
	// Hooks and invokes that take longer than this are logged at info
	// level, the others at debug, so that a normal start is a few lines.
	opts.LogThreshold = 100 * time.Millisecond
	// Every module reports health in its own scope, so /healthz, /readyz and the
	// health command name the module at fault.
	opts.ModuleDecorators = health.ModuleDecorators
	return opts
}
