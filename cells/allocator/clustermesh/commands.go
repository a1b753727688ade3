package clustermesh

import (
	"github.com/cilium/hive"
	"github.com/cilium/hive/script"

	"github.com/identityd/identityd/internal/shellfmt"
)

func newClusterMeshCommands(m *Mesh) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"clustermesh/status": clusterMeshStatusCmd(m),
	})
}

func clusterMeshStatusCmd(m *Mesh) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "Show the remote clusters of --clustermesh-config",
			Detail: []string{
				"One row per file of the directory: whether its etcd answers, whether its",
				"identities are listed, how many are known and how many master keys are",
				"rejected (ID outside the cluster's range, or no label naming the cluster).",
			},
			Flags: shellfmt.AddFlag,
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			format, err := shellfmt.NoArgsFormat(s, args)
			if err != nil {
				return nil, err
			}
			st := m.Status()
			if st == nil {
				// An empty list, not "null", in JSON and YAML.
				st = []RemoteClusterStatus{}
			}
			out, err := shellfmt.Render(format, st)
			if err != nil {
				return nil, err
			}
			return func(*script.State) (string, string, error) { return out, "", nil }, nil
		},
	)
}
