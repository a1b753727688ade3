package workloads

import (
	"errors"
	"fmt"

	"github.com/cilium/hive"
	"github.com/cilium/hive/script"
	"github.com/spf13/pflag"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/identityd/identityd/internal/shellfmt"
)

// errOff is workloads/list's answer on a node whose cell is off.
var errOff = errors.New("no pods are served on this node: no Kubernetes API server is used (neither crd mode nor --k8s-kubeconfig-path or --k8s-api-server)")

func newCommands(w *Workloads) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"workloads/list": listCmd(w),
	})
}

func listCmd(w *Workloads) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "List this node's pods: IPs, identity, state and identity labels",
			Args:    "[namespace]",
			Detail: []string{
				"One row per pod of this node the agent knows of, sorted by",
				"namespace/name. State is ready when the pod holds the identity of",
				"its labels, else why not (allocating, allocation failed N times,",
				"waiting for its namespace, host network, terminated). With a",
				"namespace, only that namespace's pods.",
			},
			Flags: func(fs *pflag.FlagSet) { shellfmt.AddFlag(fs) },
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) > 1 {
				return nil, fmt.Errorf("workloads/list takes at most one namespace, got %d arguments", len(args))
			}
			ns := ""
			if len(args) == 1 {
				ns = args[0]
				if errs := validation.IsDNS1123Label(ns); len(errs) > 0 {
					return nil, fmt.Errorf("workloads/list: %q is not a namespace name: %s", ns, errs[0])
				}
			}
			if _, err := shellfmt.Format(s.Flags); err != nil {
				return nil, err
			}
			if w == nil {
				return nil, errOff
			}
			pods := w.List()
			if ns != "" {
				kept := pods[:0]
				for _, p := range pods {
					if len(p.Name) > len(ns) && p.Name[:len(ns)+1] == ns+"/" {
						kept = append(kept, p)
					}
				}
				pods = kept
			}
			return shellfmt.Output(s.Flags, pods)
		},
	)
}
