package restoration_test

import (
	"context"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/hive/script"
	"github.com/cilium/hive/script/scripttest"
	"github.com/cilium/statedb"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/checkpoint"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/cells/restoration"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/internal/scriptengine"
)

// TestScript runs testdata/*.txtar against the cells restoration works
// with, on a state directory and a file map that outlive each hive: the
// script restarts the agent with hive/restart, and the new hive restores
// what the stopped one left. The #! line sets flags of every hive.
func TestScript(t *testing.T) {
	// Bounded, so that a retried line that cannot match fails the test
	// instead of retrying until the test binary's timeout.
	// The scripts run as parallel subtests, after this function returns.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	scripttest.Test(t, ctx,
		func(t testing.TB, args []string) *script.Engine {
			dir := t.TempDir()
			build := func() (*hive.Hive, error) {
				h := hive.New(
					cell.SimpleHealthCell, job.Cell, statedb.Cell, statedir.Cell,
					allocator.Cell, checkpoint.Cell, ipcache.Cell, restoration.Cell,
					cell.Provide(func(sh *cell.SimpleHealth) hive.ScriptCmdsOut {
						return hive.NewScriptCmds(map[string]script.Cmd{"health": cell.SimpleHealthCmd(sh)})
					}),
				)
				hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
				hive.AddConfigOverride(h, func(c *ipcache.Config) { c.IPCacheMap = string(ipcache.MapKindFile) })
				// Only the final checkpoint of a clean stop, so that what a
				// restart finds does not depend on timing.
				hive.AddConfigOverride(h, func(c *checkpoint.Config) { c.IdentityCheckpointInterval = time.Hour })
				scriptengine.ParseFlags(t, h, args)
				return h, nil
			}
			return scriptengine.NewRestartable(t, build)
		}, nil, "testdata/*.txtar")
}
