package main

import (
	"context"
	"fmt"
	"maps"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/script"
	"github.com/cilium/hive/script/scripttest"
	"github.com/spf13/pflag"
)

// restartableAgent runs the agent's hive for a script and can replace it
// with a fresh hive on the same state directory, as a restarted process
// would be. Script commands go to whichever hive is current.
type restartableAgent struct {
	t        testing.TB
	args     []string
	stateDir string

	mu   sync.Mutex
	h    *hive.Hive
	cmds map[string]script.Cmd
}

func (a *restartableAgent) build() error {
	h := newHive()
	flags := pflag.NewFlagSet("script", pflag.ContinueOnError)
	h.RegisterFlags(flags)
	// Defaults of a test agent; the script's #! line may override them.
	for name, value := range map[string]string{
		"state-dir":             a.stateDir,
		"prometheus-serve-addr": "127.0.0.1:0",
		"ipcache-map":           "file",
	} {
		if err := flags.Set(name, value); err != nil {
			return err
		}
	}
	if err := flags.Parse(a.args); err != nil {
		return fmt.Errorf("flags of the #! line: %w", err)
	}
	cmds, err := h.ScriptCommands(hivetest.Logger(a.t))
	if err != nil {
		return err
	}
	a.mu.Lock()
	a.h, a.cmds = h, cmds
	a.mu.Unlock()
	return nil
}

func (a *restartableAgent) current() (*hive.Hive, map[string]script.Cmd) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.h, a.cmds
}

// forward is a command that runs the current hive's command of its name.
type forward struct {
	a     *restartableAgent
	name  string
	usage *script.CmdUsage
}

func (f forward) Usage() *script.CmdUsage { return f.usage }

func (f forward) Run(s *script.State, args ...string) (script.WaitFunc, error) {
	_, cmds := f.a.current()
	c, ok := cmds[f.name]
	if !ok {
		return nil, fmt.Errorf("%s: not in the current agent", f.name)
	}
	return c.Run(s, args...)
}

func (a *restartableAgent) restartCmd() script.Cmd {
	return script.Command(
		script.CmdUsage{Summary: "stop the agent and start a new one on the same state directory and map"},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			h, _ := a.current()
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			log := hivetest.Logger(a.t)
			if err := h.Stop(log, ctx); err != nil {
				return nil, fmt.Errorf("stop: %w", err)
			}
			if err := a.build(); err != nil {
				return nil, err
			}
			h, _ = a.current()
			return nil, h.Start(log, ctx)
		})
}

// TestRestartScript runs testdata/restart/*.txtar against an agent that
// the script can restart with agent/restart.
func TestRestartScript(t *testing.T) {
	scripttest.Test(t, context.Background(),
		func(t testing.TB, args []string) *script.Engine {
			a := &restartableAgent{t: t, args: args, stateDir: t.TempDir()}
			if err := a.build(); err != nil {
				t.Fatal(err)
			}
			_, first := a.current()
			cmds := maps.Clone(script.DefaultCmds())
			for name, c := range first {
				cmds[name] = forward{a: a, name: name, usage: c.Usage()}
			}
			cmds["agent/restart"] = a.restartCmd()
			t.Cleanup(func() {
				h, _ := a.current()
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				h.Stop(hivetest.Logger(t), ctx)
			})
			return &script.Engine{
				Cmds:             cmds,
				RetryInterval:    20 * time.Millisecond,
				MaxRetryInterval: 500 * time.Millisecond,
			}
		}, nil, "testdata/restart/*.txtar")
}
