package doublewrite

import (
	"errors"
	"fmt"

	"github.com/cilium/hive"
	"github.com/cilium/hive/script"

	"github.com/identityd/identityd/internal/shellfmt"
)

var errNotDoubleWrite = errors.New("not in a double-write identity allocation mode (--identity-allocation-mode=doublewrite-readkvstore or doublewrite-readcrd)")

func newCommands(b *Backend) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"doublewrite/diff": diffCmd(b),
	})
}

func diffCmd(b *Backend) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "List the global identities that etcd and the CRDs do not share",
			Detail: []string{
				"Compares this node's caches of both stores now (no request to either):",
				"the first line gives each store's number of identities of this cluster's",
				"range, then one row per ID held by one store only (kvstore-only, crd-only)",
				"or by both with different label sets (labels-differ). With -o json or",
				"yaml, the rows alone. Only in the double-write modes.",
			},
			Flags: shellfmt.AddFlag,
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			format, err := shellfmt.NoArgsFormat(s, args)
			if err != nil {
				return nil, err
			}
			if b == nil {
				return nil, errNotDoubleWrite
			}
			r := b.Compare()
			out, err := shellfmt.Render(format, r.Diffs)
			if err != nil {
				return nil, err
			}
			if format == shellfmt.Table {
				synced := ""
				if !r.Synced {
					synced = " (a store is not listed yet: partial)"
				}
				out = fmt.Sprintf("kvstore %d, crd %d, kvstore-only %d, crd-only %d, labels-differ %d%s\n",
					r.KVStore, r.CRD, r.Count(OnlyKVStore), r.Count(OnlyCRD), r.Count(Mismatch), synced) + out
			}
			return func(*script.State) (string, string, error) { return out, "", nil }, nil
		},
	)
}
