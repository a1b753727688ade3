package checkpoint

import (
	"github.com/cilium/hive/cell"

	"github.com/identityd/identityd/cells/allocator"
)

// Cell provides *Checkpoint, which keeps <state-dir>/local_allocator_state.json
// in step with the allocator's local identities, allocator.LocalIdentitySyncer
// (the checkpoint's Sync, which the ipcache and identity/allocate wait for),
// and the checkpoint/write and checkpoint/show commands. It needs
// allocator.Allocator and *statedir.Dir.
//
// Its order with other cells is by contract with the allocator, not by the
// cells' positions: the final write is the allocator's finalizer
// (allocator.NewFinalizer), which runs in the allocator's stop hook after
// the stop hooks of every cell that uses the allocator; and no write
// happens before restoration has loaded the file
// (allocator.Allocator.WaitForRestoration).
var Cell = cell.Module(
	"checkpoint",
	"Checkpoint of local identities",

	cell.Config(DefaultConfig),
	cell.Provide(
		newCheckpoint,
		newCommands,
		newCheckpointMetrics,
		func(c *Checkpoint) allocator.LocalIdentitySyncer { return c },
		func(c *Checkpoint) allocator.FinalizerOut {
			return allocator.NewFinalizer(allocator.FinalizerFunc(c.finalWrite))
		},
	),
)
