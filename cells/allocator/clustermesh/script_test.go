package clustermesh

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/job"
	"github.com/cilium/hive/script"
	"github.com/cilium/hive/script/scripttest"
	"github.com/cilium/statedb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/scriptengine"
)

// TestClusterMeshScript runs testdata/*.txtar against a hive of
// cluster c1 (ID 1) without a kvstore, and one etcd serving as cluster c2
// ($ETCD2). Besides the hive's commands, scripts have:
//
//	mesh/write <name> <file>   copy a file of the archive into the
//	                           --clustermesh-config directory, expanding $VARS
//	mesh/rm <name>             remove a file from that directory
//	c2/put <key> <value>       write a key into cluster c2's etcd
func TestClusterMeshScript(t *testing.T) {
	e2 := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := e2.Client(t)
	scripttest.Test(t, context.Background(),
		func(tb testing.TB, args []string) *script.Engine {
			meshDir := tb.TempDir()
			h := hive.New(job.Cell, statedb.Cell, allocator.Cell, Cell)
			hive.AddConfigOverride(h, func(c *allocator.Config) { c.ClusterID, c.ClusterName = 1, "c1" })
			hive.AddConfigOverride(h, func(c *Config) {
				c.ClusterMeshConfig = meshDir
				c.ClusterMeshRemoteTimeout = time.Minute
			})
			return scriptengine.New(tb, h, meshScriptCmds(meshDir, cli))
		}, []string{"ETCD2=" + e2.Endpoints()[0]}, "testdata/*.txtar")
}

func meshScriptCmds(dir string, cli *clientv3.Client) map[string]script.Cmd {
	return map[string]script.Cmd{
		"mesh/write": script.Command(
			script.CmdUsage{Summary: "write a remote cluster's file", Args: "name file"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 2 {
					return nil, script.ErrUsage
				}
				data, err := os.ReadFile(s.Path(args[1]))
				if err != nil {
					return nil, err
				}
				tmp := filepath.Join(dir, "."+args[0])
				if err := os.WriteFile(tmp, []byte(s.ExpandEnv(string(data), false)), 0o600); err != nil {
					return nil, err
				}
				return nil, os.Rename(tmp, filepath.Join(dir, args[0]))
			}),
		"mesh/rm": script.Command(
			script.CmdUsage{Summary: "remove a remote cluster's file", Args: "name"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 1 {
					return nil, script.ErrUsage
				}
				return nil, os.Remove(filepath.Join(dir, args[0]))
			}),
		"c2/put": script.Command(
			script.CmdUsage{Summary: "write a key into cluster c2's etcd", Args: "key value"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 2 {
					return nil, script.ErrUsage
				}
				if _, err := cli.Put(s.Context(), args[0], args[1]); err != nil {
					return nil, fmt.Errorf("put %s: %w", args[0], err)
				}
				return nil, nil
			}),
	}
}
