package checkpoint_test

import (
	"context"
	"maps"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/hive/script"
	"github.com/cilium/hive/script/scripttest"
	"github.com/cilium/statedb"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/checkpoint"
	"github.com/identityd/identityd/cells/statedir"
)

func TestScript(t *testing.T) {
	scripttest.Test(t, context.Background(),
		func(t testing.TB, args []string) *script.Engine {
			log := hivetest.Logger(t)
			h := hive.New(
				cell.SimpleHealthCell, job.Cell, statedb.Cell, statedir.Cell,
				allocator.Cell, checkpoint.Cell,
			)
			dir := t.TempDir()
			hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
			hive.AddConfigOverride(h, func(c *checkpoint.Config) { c.IdentityCheckpointInterval = time.Hour })
			cmds, err := h.ScriptCommands(log)
			if err != nil {
				t.Fatal(err)
			}
			maps.Insert(cmds, maps.All(script.DefaultCmds()))
			t.Cleanup(func() { h.Stop(log, context.Background()) })
			return &script.Engine{Cmds: cmds, RetryInterval: 10 * time.Millisecond, MaxRetryInterval: 200 * time.Millisecond}
		}, nil, "testdata/*.txtar")
}
