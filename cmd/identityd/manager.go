package main

import (
	"io"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/cobra"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/k8sclient"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/cells/workloads"
)

// managerCells are the cells of `identityd manager`: a store of global
// identities, the allocator over it and the identity manager, without the
// node's datapath (no checkpoint, ipcache, restoration or shell).
var managerCells = []cell.Cell{
	health.Cell,
	metrics.Cell,
	job.Cell,
	statedb.Cell,
	statedir.Cell,
	kvstore.Cell,
	k8sclient.Cell,
	allocator.Cell,
	etcdstore.Cell,
	crdstore.Cell,
	workloads.ManagerCell,
}

// newManagerCmd is `identityd manager`, with a hive of its own.
func newManagerCmd(stderr io.Writer, logOpts *logOptions) *cobra.Command {
	h := hive.NewWithOptions(agentOptions(), managerCells...)
	cmd := &cobra.Command{
		Use:   "manager",
		Short: "Run the identity manager: one elected replica holds the identity of every pod's label set",
		Long: "Runs the identity manager of --identity-management-mode=operator: of its replicas,\n" +
			"the one holding the Lease identityd-manager-<cluster ID> creates and holds the\n" +
			"global identity of every label set the cluster's pods have, in crd or kvstore\n" +
			"mode, and agents in operator mode only adopt them. See docs/guides.md,\n" +
			"\"Operator-managed identities\".",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return runHive(h, *logOpts, stderr)
		},
	}
	h.RegisterFlags(cmd.Flags())
	return cmd
}
