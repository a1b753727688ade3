package kvstore_test

import (
	"context"
	"maps"
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/script"
	"github.com/cilium/hive/script/scripttest"

	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/statedir"
)

// TestScript runs testdata/*.txtar, each against its own hive with an
// embedded etcd in a fresh state directory.
func TestScript(t *testing.T) {
	scripttest.Test(t, context.Background(),
		func(tb testing.TB, args []string) *script.Engine {
			log := hivetest.Logger(tb)
			h := hive.New(statedir.Cell, kvstore.Cell)
			hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = tb.TempDir() })
			hive.AddConfigOverride(h, func(c *kvstore.Config) { c.NodeName = "script-node" })
			tb.Cleanup(func() {
				// Scripts normally stop the hive themselves; this covers
				// failures in between.
				h.Stop(log, context.Background())
			})
			cmds, err := h.ScriptCommands(log)
			if err != nil {
				tb.Fatalf("script commands: %v", err)
			}
			maps.Insert(cmds, maps.All(script.DefaultCmds()))
			return &script.Engine{Cmds: cmds}
		}, nil, "testdata/*.txtar")
}
