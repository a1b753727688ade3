// Package scriptengine builds the script engine that the cells' script
// tests (testdata/*.txtar) run against a hive: the hive's own commands,
// the script language's default commands, and the retry pacing of `*`
// lines. The hive is stopped when the test ends.
package scriptengine

import (
	"context"
	"maps"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/script"
	"github.com/spf13/pflag"
)

// New returns an engine with the commands of h, the default commands and
// any extra commands a test adds.
func New(tb testing.TB, h *hive.Hive, extra ...map[string]script.Cmd) *script.Engine {
	log := hivetest.Logger(tb)
	cmds, err := h.ScriptCommands(log)
	if err != nil {
		tb.Fatalf("script commands: %v", err)
	}
	maps.Insert(cmds, maps.All(script.DefaultCmds()))
	for _, e := range extra {
		maps.Insert(cmds, maps.All(e))
	}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		h.Stop(log, ctx)
	})
	return &script.Engine{Cmds: cmds, RetryInterval: 20 * time.Millisecond, MaxRetryInterval: 500 * time.Millisecond}
}

// ParseFlags applies a script's "#!" line (args) to the hive's flags, as
// the agent's command line would.
func ParseFlags(tb testing.TB, h *hive.Hive, args []string) {
	flags := pflag.NewFlagSet("script", pflag.ContinueOnError)
	h.RegisterFlags(flags)
	if err := flags.Parse(args); err != nil {
		tb.Fatalf("flags of the #! line: %v", err)
	}
}
