package main

import (
	"context"
	"fmt"
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/script"
	"github.com/cilium/hive/script/scripttest"
	"github.com/spf13/pflag"

	"github.com/identityd/identityd/internal/scriptengine"
)

// restartCmd is the scripts' name for scriptengine.RestartCmd.
const restartCmd = "agent/restart"

// TestRestartScript runs testdata/restart/*.txtar against an agent that
// the script can restart with agent/restart: the agent's hive is replaced
// by a fresh one on the same state directory and map, as a restarted
// process would be, and script commands go to whichever hive is current.
func TestRestartScript(t *testing.T) {
	// Each script holds a process slot, not the test that runs them.
	t.Parallel()
	scripttest.Test(t, context.Background(),
		func(t testing.TB, args []string) *script.Engine {
			processSlot(t)
			stateDir := t.TempDir()
			build := func() (*hive.Hive, error) {
				h := newHive()
				flags := pflag.NewFlagSet("script", pflag.ContinueOnError)
				h.RegisterFlags(flags)
				// Defaults of a test agent; the script's #! line may override them.
				for name, value := range map[string]string{
					"state-dir":             stateDir,
					"prometheus-serve-addr": "127.0.0.1:0",
					"ipcache-map":           "file",
				} {
					if err := flags.Set(name, value); err != nil {
						return nil, err
					}
				}
				if err := flags.Parse(args); err != nil {
					return nil, fmt.Errorf("flags of the #! line: %w", err)
				}
				return h, nil
			}
			e := scriptengine.NewRestartable(t, build)
			e.Cmds[restartCmd] = e.Cmds[scriptengine.RestartCmd]
			delete(e.Cmds, scriptengine.RestartCmd)
			return e
		}, nil, "testdata/restart/*.txtar")
}
