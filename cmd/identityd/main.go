// Command identityd runs the identityd agent: the allocator, kvstore,
// checkpoint, ipcache and restoration cells in one hive. Its subcommands
// inspect the hive (hive, hive dot-graph), reach the running agent's shell
// (shell), copy global identities between the stores (migrate), run the
// identity manager (manager) and print the version (version).
package main

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime/debug"
	"strings"

	"github.com/cilium/hive"
	"github.com/lmittmann/tint"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/identityd/identityd/cells/shell"
	"github.com/identityd/identityd/cells/statedir"
)

// version is set at build time with -ldflags "-X main.version=…".
var version = ""

func main() {
	if err := newRootCmd(newHive(), os.Stdout, os.Stderr).Execute(); err != nil {
		fmt.Fprintf(os.Stderr, "identityd: %s\n", oneLine(err))
		os.Exit(1)
	}
}

// oneLine folds a multi-line error (hive joins start errors with newlines)
// into one readable line.
func oneLine(err error) string {
	return strings.Join(strings.Fields(strings.ReplaceAll(err.Error(), "\n", "; ")), " ")
}

type logOptions struct {
	format string
	level  string
}

func (o logOptions) logger(w io.Writer) (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(o.level)); err != nil {
		return nil, fmt.Errorf("invalid --log-level %q: want debug, info, warn or error", o.level)
	}
	switch o.format {
	case "text":
		f, isFile := w.(*os.File)
		color := isFile && term.IsTerminal(int(f.Fd()))
		return slog.New(tint.NewTextHandler(w, &tint.Options{Level: level, NoColor: !color})), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, &slog.HandlerOptions{Level: level})), nil
	}
	return nil, fmt.Errorf("invalid --log-format %q: want text or json", o.format)
}

func newRootCmd(h *hive.Hive, stdout, stderr io.Writer) *cobra.Command {
	var logOpts logOptions
	root := &cobra.Command{
		Use:           "identityd",
		Short:         "Security identities for network agents: allocation, etcd, checkpoint, ipcache, restoration",
		SilenceUsage:  true,
		SilenceErrors: true,
		Args:          cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return runHive(h, logOpts, stderr)
		},
	}
	root.PersistentFlags().StringVar(&logOpts.format, "log-format", "text", "Log format: text or json")
	root.PersistentFlags().StringVar(&logOpts.level, "log-level", "info", "Log level: debug, info, warn or error")
	h.RegisterFlags(root.Flags())
	root.AddCommand(h.Command(), newShellCmd(stdout), newVersionCmd(stdout), newMigrateCmd(stdout, &logOpts), newManagerCmd(stderr, &logOpts))
	return root
}

// runHive runs h until a signal or a failure, logging to stderr as the
// log flags say.
func runHive(h *hive.Hive, logOpts logOptions, stderr io.Writer) error {
	log, err := logOpts.logger(stderr)
	if err != nil {
		return err
	}
	slog.SetDefault(log)
	return h.Run(log)
}

func newVersionCmd(stdout io.Writer) *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the version",
		Args:  cobra.NoArgs,
		Run: func(cmd *cobra.Command, args []string) {
			fmt.Fprintf(stdout, "identityd %s\n", versionString())
		},
	}
}

func versionString() string {
	if version != "" {
		return version
	}
	if bi, ok := debug.ReadBuildInfo(); ok {
		v := bi.Main.Version
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" {
				v += " " + s.Value
			}
		}
		return v + " " + bi.GoVersion
	}
	return "unknown"
}

func newShellCmd(stdout io.Writer) *cobra.Command {
	var stateDir, sockPath string
	cmd := &cobra.Command{
		Use:   "shell [-- command [args...]]",
		Short: "Run a command in the running agent's shell, or open an interactive shell",
		Long: "Connects to the agent's shell socket (<state-dir>/" + shell.SocketName + ").\n" +
			"With a command, runs it with its arguments exactly as given (nothing is split,\n" +
			"expanded or taken as a comment) and exits non-zero if it fails; without, reads\n" +
			"commands line by line, split like a POSIX shell's words (quotes and backslashes,\n" +
			"no expansion). See docs/operations.md, \"Shell protocol\".\n" +
			"Example: identityd shell --state-dir .identityd -- identity/allocate 'k8s:app=a b'",
		RunE: func(cmd *cobra.Command, args []string) error {
			if sockPath == "" {
				sockPath = statedir.New(stateDir).Join(shell.SocketName)
			}
			if len(args) > 0 {
				return runShellCommand(cmd.Context(), sockPath, stdout, cmd.ErrOrStderr(), args)
			}
			return interactiveShell(cmd.Context(), sockPath, cmd.InOrStdin(), stdout, cmd.ErrOrStderr())
		},
	}
	cmd.Flags().StringVar(&stateDir, "state-dir", statedir.DefaultConfig.StateDir, "State directory of the agent to reach")
	cmd.Flags().StringVar(&sockPath, "shell-sock-path", "", "Path of the shell socket (default <state-dir>/"+shell.SocketName+")")
	return cmd
}
