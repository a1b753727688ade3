package shell_test

import (
	"context"
	"os"
	"strings"
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/script"
	hiveshell "github.com/cilium/hive/shell"
	"go.uber.org/goleak"

	"github.com/identityd/identityd/cells/shell"
	"github.com/identityd/identityd/cells/statedir"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestShell(t *testing.T) {
	dir := t.TempDir()
	h := hive.New(statedir.Cell, shell.Cell,
		cell.Provide(func() hive.ScriptCmdOut {
			return hive.NewScriptCmd("test/echo", script.Command(script.CmdUsage{Summary: "echo"},
				func(s *script.State, args ...string) (script.WaitFunc, error) {
					if len(args) > 0 && args[0] == "fail" {
						return nil, os.ErrInvalid
					}
					if len(args) > 0 && args[0] == "panic" {
						panic("boom")
					}
					out := strings.Join(args, " ") + "\n"
					return func(*script.State) (string, string, error) { return out, "", nil }, nil
				}))
		}))
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	log := hivetest.Logger(t)
	if err := h.Start(log, context.Background()); err != nil {
		t.Fatal(err)
	}
	defer h.Stop(log, context.Background())

	sock := dir + "/" + shell.SocketName
	fi, err := os.Stat(sock)
	if err != nil || fi.Mode().Perm() != 0o600 || fi.Mode()&os.ModeSocket == 0 {
		t.Fatalf("socket %v, %v; want a 0600 socket", fi, err)
	}
	cfg := hiveshell.Config{ShellSockPath: sock}
	var out strings.Builder
	if err := hiveshell.ShellExchange(cfg, &out, "test/echo hello world"); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "hello world") {
		t.Fatalf("output %q", out.String())
	}
	out.Reset()
	if err := hiveshell.ShellExchange(cfg, &out, "help"); err != nil || !strings.Contains(out.String(), "test/echo") {
		t.Fatalf("help: %v %q", err, out.String())
	}
	// A failing command is an error on one line; the server lives on.
	if err := hiveshell.ShellExchange(cfg, &out, "test/echo fail"); err == nil || strings.Contains(err.Error(), "\n") {
		t.Fatalf("failing command: %v", err)
	}
	if err := hiveshell.ShellExchange(cfg, &out, "test/echo panic"); err == nil || !strings.Contains(err.Error(), "boom") {
		t.Fatalf("panicking command: %v", err)
	}
	out.Reset()
	if err := hiveshell.ShellExchange(cfg, &out, "test/echo still here"); err != nil || !strings.Contains(out.String(), "still here") {
		t.Fatalf("after errors: %v %q", err, out.String())
	}
}
