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
var Cell = cell.Module(
	"checkpoint",
	"Checkpoint of local identities",

	cell.Config(DefaultConfig),
	cell.Provide(
		newCheckpoint,
		newCommands,
		newCheckpointMetrics,
		func(c *Checkpoint) allocator.LocalIdentitySyncer { return c },
	),

	// The checkpoint attaches to the allocator as soon as the allocator is
	// constructed, before any other cell receives it. Its stop hook is
	// thus appended right after the allocator's and runs after the stop
	// hooks of every cell that uses the allocator, so that their last
	// allocations and releases are in the final write, whatever the
	// order in which the cells are listed.
	cell.DecorateAll(attach),

	// Construct the allocator (and so attach) even if nothing else in
	// the hive asks for it.
	cell.Invoke(func(allocator.Allocator) {}),
)

func attach(a allocator.Allocator, c *Checkpoint, lc cell.Lifecycle) allocator.Allocator {
	c.attach(a, lc)
	return a
}
