package restoration

import (
	"github.com/cilium/hive/cell"

	"github.com/identityd/identityd/cells/allocator"
)

// Cell provides *Restorer and the identity/restore-status command. It needs
// allocator.Allocator, *checkpoint.Checkpoint, *ipcache.IPCache, jobs and
// health; an AutomaticGracePeriod is optional (it only chooses the default
// grace period).
//
// Its order with other cells is by contract, not by the cells' positions:
// the Restorer registers with the allocator as its allocator.Restoration,
// and local allocations other than restoration's own wait until its start
// hook has finished (allocator.Allocator.WaitForRestoration), as do the
// checkpoint's writes and the ipcache's writes to the datapath map.
// Registering is what constructs the Restorer, so it needs no invoke.
var Cell = cell.Module(
	"restoration",
	"Restores local identities and ipcache entries at start",

	cell.Config(DefaultConfig),
	cell.Provide(
		newRestorer,
		newCommands,
		func(r *Restorer) allocator.RestorationOut { return allocator.NewRestoration(r) },
		newRestorationMetrics,
	),
)
