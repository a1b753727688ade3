// Package readme is the composition README.md shows, in a module of its
// own as another agent has it; its tests run it against the real servers
// of github.com/identityd/identityd/testenv. The code below the package
// clause is README.md's, which cmd/identityd's TestReadmeComposition
// keeps equal (go test ./cmd/identityd -run TestReadmeComposition
// -update-docs rewrites it).
package readme

import (
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"

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

// newHive composes identityd's cells with the agent's own cell and
// registers their flags.
func newHive(flags *pflag.FlagSet, myAgentCell cell.Cell) *hive.Hive {
	opts := hive.DefaultOptions()
	opts.EnvPrefix = "MYAGENT_"                     // flags from MYAGENT_<FLAG>, never NODE_NAME & co.
	opts.ModuleDecorators = health.ModuleDecorators // one health scope per module, for /healthz
	opts.LogThreshold = 100 * time.Millisecond      // slower hooks are logged at info level
	h := hive.NewWithOptions(opts,
		health.Cell, metrics.Cell, job.Cell, statedb.Cell, statedir.Cell,
		// The socket `identityd shell --state-dir DIR` talks to
		// (<state-dir>/identityd.sock): without it the shell finds no agent.
		shell.Cell,
		kvstore.Cell, allocator.Cell, etcdstore.Cell, clustermesh.Cell,
		// The CRD store: with --identity-allocation-mode=crd, global
		// identities are CiliumIdentity objects in the API server of
		// --k8s-kubeconfig-path (or --k8s-api-server, or in-cluster).
		k8sclient.Cell, crdstore.Cell,
		// The double-write modes (doublewrite-readkvstore,
		// doublewrite-readcrd) that move a cluster between the two
		// stores; in the other modes it starts nothing.
		doublewrite.Cell,
		checkpoint.Cell, ipcache.Cell, restoration.Cell,
		// The identities of this node's pods, their IPs in the ipcache:
		// only with a Kubernetes API server (crd mode, or a kubeconfig).
		workloads.Cell,
		// What --identity-restore-grace-period=0 stands for, as identityd --help
		// says: 10m with external etcd endpoints (or the API server), 30s with the
		// embedded etcd. Without it the restorer takes 30s everywhere.
		cell.Provide(func(mode identity.AllocationMode, c *kvstore.Client) restoration.AutomaticGracePeriod {
			return restoration.AutomaticGracePeriodFor(mode.UsesCRD() || !c.Embedded())
		}),
		myAgentCell)
	h.RegisterFlags(flags) // configuration is the cells' flags
	return h
}
