package allocator

import (
	"strings"
	"testing"

	"github.com/cilium/hive/script"

	"github.com/identityd/identityd/identity"
)

// TestCommandErrors checks that bad input gets one readable line.
func TestCommandErrors(t *testing.T) {
	a, _, _ := testAllocator(t, identity.MaxLocalIdentity)
	cmds := newCommands(a).ScriptCmds
	e := script.Engine{Cmds: map[string]script.Cmd{}}
	for _, c := range cmds {
		e.Cmds[c.Name] = c.Cmd
	}
	for line, want := range map[string]string{
		"identity/allocate 'cidr:10.0.0.0/8;x'": `invalid label "cidr:10.0.0.0/8;x": ';' is not allowed`,
		"identity/allocate =x":                  `invalid label "=x": empty key`,
		"identity/release 99999999":             "identity not held by this node: 99999999",
		"identity/release abc":                  `invalid numeric identity "abc"`,
		"identity/get 16777299":                 "identity 16777299 not found",
		"identity/allocate":                     "usage",
		"identity/list -o xml":                  `unknown output format "xml"`,
		"identity/allocate k8s:app=web":         "global identities need a kvstore",
		"identity/allocate k8s:a=b k8s:a=c":     "duplicate key",
	} {
		s, err := script.NewState(t.Context(), t.TempDir(), nil)
		if err != nil {
			t.Fatal(err)
		}
		var out strings.Builder
		err = e.ExecuteLine(s, line, &out)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: error %v, want one containing %q", line, err, want)
			continue
		}
		if strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: error spans lines: %q", line, err)
		}
	}
}
