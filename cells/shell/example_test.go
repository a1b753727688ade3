package shell_test

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/hive/script"
	"github.com/spf13/pflag"

	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/shell"
	"github.com/identityd/identityd/cells/statedir"
)

// greetCmd is a command of the agent's own cell: every command a cell
// registers is served on the shell's socket.
func greetCmd() script.Cmd {
	return script.Command(script.CmdUsage{Summary: "greet someone", Args: "name"},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			return func(*script.State) (string, string, error) {
				return "hello " + strings.Join(args, " ") + "\n", "", nil
			}, nil
		})
}

// The agent serves its commands on <state-dir>/identityd.sock; a Client
// runs one with exactly the arguments given, which Split takes from a
// command line as a shell would.
func Example() {
	dir, err := os.MkdirTemp("", "shell-example")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)
	h := hive.New(health.Cell, job.Cell, statedir.Cell, shell.Cell,
		cell.Provide(func() hive.ScriptCmdsOut {
			return hive.NewScriptCmds(map[string]script.Cmd{"greet": greetCmd()})
		}))
	fs := pflag.NewFlagSet("agent", pflag.ContinueOnError)
	h.RegisterFlags(fs)
	fs.Set("state-dir", dir)
	log := slog.New(slog.DiscardHandler)
	ctx := context.Background()
	if err := h.Start(log, ctx); err != nil {
		panic(err)
	}
	defer h.Stop(log, ctx)

	c, err := shell.Dial(ctx, filepath.Join(dir, shell.SocketName))
	if err != nil {
		panic(err)
	}
	defer c.Close()
	args, err := shell.Split(`greet "the world; and more"`)
	if err != nil {
		panic(err)
	}
	if err := c.Run(ctx, os.Stdout, args...); err != nil {
		panic(err)
	}
	// Output:
	// hello the world; and more
}
