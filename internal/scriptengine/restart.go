package scriptengine

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/script"
)

// RestartCmd is the command of a restartable engine that stops the current
// hive and starts a fresh one from the same build function, as a restarted
// agent process would start on the state its predecessor left.
const RestartCmd = "hive/restart"

// NewRestartable is New for scripts that restart the agent: build returns
// a fresh hive each time it is called (on the same state directory), the
// script's commands run on the current hive, and RestartCmd replaces it.
// The current hive is stopped when the test ends.
func NewRestartable(tb testing.TB, build func() (*hive.Hive, error), extra ...map[string]script.Cmd) *script.Engine {
	r := &restarter{log: hivetest.Logger(tb), build: build}
	if err := r.replace(); err != nil {
		tb.Fatalf("script commands: %v", err)
	}
	_, first := r.current()
	cmds := maps.Clone(script.DefaultCmds())
	for name, c := range first {
		cmds[name] = onCurrent{r: r, name: name, usage: c.Usage()}
	}
	for _, e := range extra {
		maps.Insert(cmds, maps.All(e))
	}
	cmds[RestartCmd] = script.Command(
		script.CmdUsage{Summary: "Stop the hive and start a fresh one on the same state"},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) > 0 {
				return nil, script.ErrUsage
			}
			return nil, r.restart()
		})
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		h, _ := r.current()
		h.Stop(r.log, ctx)
	})
	return &script.Engine{Cmds: cmds, RetryInterval: 20 * time.Millisecond, MaxRetryInterval: 500 * time.Millisecond}
}

// restarter holds the hive a restartable engine runs on now.
type restarter struct {
	log   *slog.Logger
	build func() (*hive.Hive, error)

	mu   sync.Mutex
	h    *hive.Hive
	cmds map[string]script.Cmd
}

// replace builds the next hive and makes it current.
func (r *restarter) replace() error {
	h, err := r.build()
	if err != nil {
		return err
	}
	cmds, err := h.ScriptCommands(r.log)
	if err != nil {
		return err
	}
	r.mu.Lock()
	r.h, r.cmds = h, cmds
	r.mu.Unlock()
	return nil
}

func (r *restarter) current() (*hive.Hive, map[string]script.Cmd) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.h, r.cmds
}

// restart stops the current hive, which writes what a clean stop writes,
// then starts the next one.
func (r *restarter) restart() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	old, _ := r.current()
	if err := old.Stop(r.log, ctx); err != nil {
		return fmt.Errorf("stop: %w", err)
	}
	if err := r.replace(); err != nil {
		return err
	}
	h, _ := r.current()
	if err := h.Start(r.log, ctx); err != nil {
		return fmt.Errorf("start after restart: %w", err)
	}
	return nil
}

// onCurrent runs the command of its name of whichever hive is current.
type onCurrent struct {
	r     *restarter
	name  string
	usage *script.CmdUsage
}

func (c onCurrent) Usage() *script.CmdUsage { return c.usage }

func (c onCurrent) Run(s *script.State, args ...string) (script.WaitFunc, error) {
	_, cmds := c.r.current()
	cmd, ok := cmds[c.name]
	if !ok {
		return nil, fmt.Errorf("%s: not a command of the restarted hive", c.name)
	}
	return cmd.Run(s, args...)
}
