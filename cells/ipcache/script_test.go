package ipcache_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/hive/script"
	"github.com/cilium/hive/script/scripttest"
	"github.com/cilium/statedb"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/ipcachemap"
	"github.com/identityd/identityd/internal/scriptengine"
)

func TestScript(t *testing.T) {
	scripttest.Test(t, context.Background(),
		func(t testing.TB, args []string) *script.Engine {
			dir := t.TempDir()
			var ipc *ipcache.IPCache
			h := hive.New(
				cell.SimpleHealthCell, job.Cell, statedb.Cell, statedir.Cell,
				allocator.Cell, ipcache.Cell,
				cell.Invoke(func(c *ipcache.IPCache) { ipc = c }),
				cell.Provide(func(sh *cell.SimpleHealth) hive.ScriptCmdsOut {
					return hive.NewScriptCmds(map[string]script.Cmd{"health": cell.SimpleHealthCmd(sh)})
				}),
			)
			hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
			// Remote nodes' label sets get remote-node-scope identities, as the
			// tests expect (Cilium's --policy-cidr-match-mode=nodes).
			hive.AddConfigOverride(h, func(c *allocator.Config) { c.PolicyCIDRMatchMode = []string{allocator.PolicyCIDRMatchNodes} })
			hive.AddConfigOverride(h, func(c *ipcache.Config) {
				c.IPCacheMap = string(ipcachemap.KindFile)
				for _, a := range args {
					if v, ok := strings.CutPrefix(a, "max-entries="); ok {
						fmt.Sscan(v, &c.IPCacheMapMaxEntries)
					}
				}
			})
			e := scriptengine.New(t, h, testCmds(dir, func() *ipcache.IPCache { return ipc }))
			for name, c := range e.Cmds {
				// Only the cells' commands: the script's own (stdout, …)
				// must keep the previous command's output.
				if strings.Contains(name, "/") {
					e.Cmds[name] = errToStderr{c}
				}
			}
			return e
		}, nil, "testdata/*.txtar")
}

// errToStderr makes a command's error its stderr, so that a script can
// check what a refused command said (`! cmd` then `stderr 'reason'`), as
// `identityd shell` prints it.
type errToStderr struct{ script.Cmd }

func (c errToStderr) Run(s *script.State, args ...string) (script.WaitFunc, error) {
	wait, err := c.Cmd.Run(s, args...)
	if err != nil && wait == nil && !errors.Is(err, script.ErrUsage) {
		return func(*script.State) (string, string, error) { return "", err.Error() + "\n", err }, nil
	}
	return wait, err
}

// testCmds are commands that only tests need: they write the map file
// before the hive starts and stand in for the restoration cell.
func testCmds(dir string, ipc func() *ipcache.IPCache) map[string]script.Cmd {
	var initDone func()
	return map[string]script.Cmd{
		"test/prewrite": script.Command(
			script.CmdUsage{Summary: "Write prefix=identity entries into the map file (before hive/start)", Args: "prefix=id..."},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				m, _, err := ipcachemap.Open(ipcachemap.Config{Kind: ipcachemap.KindFile, FilePath: dir + "/" + ipcachemap.FileName})
				if err != nil {
					return nil, err
				}
				for _, a := range args {
					p, id, ok := strings.Cut(a, "=")
					if !ok {
						m.Close()
						return nil, script.ErrUsage
					}
					k, err := parseKey(p)
					if err != nil {
						m.Close()
						return nil, err
					}
					nid, err := identity.ParseNumericIdentity(id)
					if err != nil {
						m.Close()
						return nil, err
					}
					if err := m.Update(k, ipcachemap.Value{Identity: nid}); err != nil {
						m.Close()
						return nil, err
					}
				}
				return nil, m.Close()
			}),
		"test/hold-init": script.Command(
			script.CmdUsage{Summary: "Register a table initializer, as restoration does"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				initDone = ipc().RegisterInitializer("test")
				return nil, nil
			}),
		"test/release-init": script.Command(
			script.CmdUsage{Summary: "Mark the test initializer done"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				initDone()
				return nil, nil
			}),
		"test/snapshot": script.Command(
			script.CmdUsage{Summary: "Take the map snapshot and print it"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				var b strings.Builder
				for _, e := range ipc().TakeSnapshot() {
					fmt.Fprintf(&b, "%s %d\n", e.Key, e.Value.Identity)
				}
				out := b.String()
				return func(*script.State) (string, string, error) { return out, "", nil }, nil
			}),
		"test/wait-map": script.Command(
			script.CmdUsage{Summary: "Wait until the map holds the table"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				ctx, cancel := context.WithTimeout(s.Context(), 10*time.Second)
				defer cancel()
				return nil, ipc().WaitForMap(ctx)
			}),
	}
}

func parseKey(s string) (ipcachemap.Key, error) {
	p, err := netip.ParsePrefix(s)
	return ipcachemap.Key{Prefix: p}, err
}
