package main

import (
	"context"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/script"
	"github.com/cilium/hive/script/scripttest"
	"github.com/spf13/pflag"

	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/k8stest"
)

// TestScript runs testdata/*.txtar, each against a fresh agent hive with its
// own state directory, through the same commands the shell offers. A
// script's first line may set agent flags: "#! --identity-restore-grace-period=1s".
func TestScript(t *testing.T) {
	// Each script holds a process slot, not the test that runs them.
	t.Parallel()
	scripttest.Test(t, context.Background(),
		func(t testing.TB, args []string) *script.Engine {
			processSlot(t)
			h := newHive()
			flags := pflag.NewFlagSet("script", pflag.ContinueOnError)
			h.RegisterFlags(flags)
			if err := flags.Parse(args); err != nil {
				t.Fatalf("flags of the #! line: %s", err)
			}
			// A script in crd mode gets a real API server of its own,
			// which apiserver/restart restarts.
			var srv *k8stest.Server
			if mode, _ := flags.GetString("identity-allocation-mode"); mode == string(identity.AllocationModeCRD) {
				srv = k8stest.Start(t)
				if err := flags.Set("k8s-kubeconfig-path", srv.Kubeconfig()); err != nil {
					t.Fatal(err)
				}
			}
			stateDir := t.TempDir()
			hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = stateDir })
			// Scripts run in parallel: a fixed metrics port would clash.
			hive.AddConfigOverride(h, func(c *metrics.Config) { c.PrometheusServeAddr = "127.0.0.1:0" })
			// Never the host's pinned map: scripts run in parallel.
			hive.AddConfigOverride(h, func(c *ipcache.Config) { c.IPCacheMap = "file" })
			log := hivetest.Logger(t)
			cmds, err := h.ScriptCommands(log)
			if err != nil {
				t.Fatalf("ScriptCommands: %s", err)
			}
			maps.Insert(cmds, maps.All(script.DefaultCmds()))
			// The built-in "hive" command prints to the log, which scripts
			// cannot match; this one prints the same to stdout.
			cmds["hive/objects"] = script.Command(
				script.CmdUsage{Summary: "print the hive's cells and objects to stdout"},
				func(s *script.State, args ...string) (script.WaitFunc, error) {
					var b strings.Builder
					err := h.PrintObjects(&b, log)
					return func(*script.State) (string, string, error) { return b.String(), "", err }, nil
				})
			// Scripts cannot name the state directory (it is not their
			// work directory), yet restoration reads what a previous run
			// left there.
			cmds["statedir/put"] = script.Command(
				script.CmdUsage{
					Summary: "copy files of the script's work directory into the agent's state directory",
					Args:    "file...",
				},
				func(s *script.State, args ...string) (script.WaitFunc, error) {
					if len(args) == 0 {
						return nil, script.ErrUsage
					}
					for _, name := range args {
						data, err := os.ReadFile(s.Path(name))
						if err != nil {
							return nil, err
						}
						if err := os.WriteFile(filepath.Join(stateDir, filepath.Base(name)), data, 0o600); err != nil {
							return nil, err
						}
					}
					return nil, nil
				})
			if srv != nil {
				cmds["apiserver/restart"] = script.Command(
					script.CmdUsage{Summary: "stop the script's Kubernetes API server and start it again on the same port (crd mode)"},
					func(s *script.State, args ...string) (script.WaitFunc, error) {
						srv.Restart(t)
						return nil, nil
					})
			}
			t.Cleanup(func() {
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				h.Stop(log, ctx)
			})
			return &script.Engine{
				Cmds:             cmds,
				RetryInterval:    10 * time.Millisecond,
				MaxRetryInterval: 500 * time.Millisecond,
			}
		}, nil, "testdata/*.txtar")
}
