package restoration

import (
	"github.com/cilium/hive/cell"
)

// Cell provides *Restorer and the identity/restore-status command. It needs
// allocator.Allocator, *checkpoint.Checkpoint, *ipcache.IPCache, jobs and
// health; *kvstore.Client is optional (it only chooses the default grace
// period).
//
// The cell constructs its Restorer itself, at the cell's place in the hive:
// list it right after the ipcache cell so that its start hook runs before
// the start hooks of cells listed after it, whether they depend on it or
// not.
var Cell = cell.Module(
	"restoration",
	"Restores local identities and ipcache entries at start",

	cell.Config(DefaultConfig),
	cell.Provide(
		newRestorer,
		newCommands,
		newRestorationMetrics,
	),

	// Start hooks run in the order their constructors ran. Constructing
	// the Restorer here, rather than when a later cell first asks for
	// it, puts its hook right after those of its dependencies and ahead
	// of every cell constructed later.
	cell.Invoke(func(*Restorer) {}),
)
