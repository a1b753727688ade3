package checkpoint_test

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
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/internal/scriptengine"
)

func TestScript(t *testing.T) {
	scripttest.Test(t, context.Background(),
		func(t testing.TB, args []string) *script.Engine {
			h := hive.New(
				cell.SimpleHealthCell, job.Cell, statedb.Cell, statedir.Cell,
				allocator.Cell, checkpoint.Cell,
			)
			dir := t.TempDir()
			hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
			hive.AddConfigOverride(h, func(c *checkpoint.Config) { c.IdentityCheckpointInterval = time.Hour })
			scriptengine.ParseFlags(t, h, args)
			return scriptengine.New(t, h)
		}, nil, "testdata/*.txtar")
}
