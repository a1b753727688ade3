package kvstore_test

import (
	"context"
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/script"
	"github.com/cilium/hive/script/scripttest"

	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/internal/scriptengine"
)

// TestScript runs testdata/*.txtar, each against its own hive with an
// embedded etcd in a fresh state directory.
func TestScript(t *testing.T) {
	scripttest.Test(t, context.Background(),
		func(tb testing.TB, args []string) *script.Engine {
			h := hive.New(statedir.Cell, kvstore.Cell)
			hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = tb.TempDir() })
			hive.AddConfigOverride(h, func(c *kvstore.Config) { c.NodeName = "script-node" })
			return scriptengine.New(tb, h)
		}, nil, "testdata/*.txtar")
}
