package allocator

import (
	"io"
	"strings"
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/script"

	"github.com/identityd/identityd/identity"
)

// FuzzCommandLine feeds arbitrary argument lines to the identity/* shell
// commands, through the script engine that runs testdata scripts: word
// splitting and quoting, flags, label parsing and numeric ID parsing. No
// input may panic, and every error must fit on one line, as the shell
// shows a command's error on one line.
func FuzzCommandLine(f *testing.F) {
	verbs := []string{"identity/allocate", "identity/release", "identity/get", "identity/list"}
	for _, seed := range []struct {
		verb uint8
		args string
	}{
		{0, "cidr:10.0.0.0/8 reserved:world"},
		{0, "-o json --old-id 16777300 cidr:192.0.2.0/24 reserved:world"},
		{0, "'cidr:10.0.0.0/8;x'"},
		{0, "k8s:a=b k8s:a=c"},
		{0, "fqdn:'example.com' reserved:world"},
		{1, "16777217"},
		{1, "-1"},
		{1, "4294967296"},
		{2, "k8s:app=web"},
		{2, "2"},
		{3, "--source local -o yaml"},
		{3, "-o xml"},
	} {
		f.Add(seed.verb, seed.args)
	}
	a, _, _ := testAllocator(f, identity.MaxLocalIdentity)
	cmds := newCommands(a).ScriptCmds
	e := script.Engine{Cmds: map[string]script.Cmd{}}
	for _, c := range cmds {
		e.Cmds[c.Name] = c.Cmd
	}
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, verb uint8, args string) {
		// A script runs one line per command; a trailing '&' would run
		// the command in the background of a state nobody waits on.
		if strings.ContainsAny(args, "\r\n") || strings.HasSuffix(strings.TrimSpace(args), "&") {
			return
		}
		v := verbs[int(verb)%len(verbs)]
		s, err := script.NewState(t.Context(), dir, nil)
		if err != nil {
			t.Fatal(err)
		}
		err = e.ExecuteLine(s, v+" "+args, io.Discard)
		if err != nil && strings.ContainsAny(err.Error(), "\r\n") {
			t.Fatalf("%s %q: error spans lines: %q", v, args, err)
		}
		// Drop every reference taken, so the allocator's state stays
		// small however long the fuzzing runs.
		for _, en := range a.List() {
			if en.Source != SourceLocal {
				continue
			}
			for range en.RefCount {
				if _, err := a.Release(t.Context(), en.Identity); err != nil {
					t.Fatalf("releasing %s: %v", en.Identity, err)
				}
			}
		}
	})
}

// newCommands returns the commands without a durability point to wait for.
func newCommands(a Allocator) hive.ScriptCmdsOut {
	return newCommandsSync(a, nil, DefaultConfig.IdentityAllocationTimeout)
}
