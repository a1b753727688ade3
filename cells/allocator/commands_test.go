package allocator

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"runtime"
	"strings"
	"testing"
	"time"

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
		"identity/allocate k8s:app=web":         "global identities need a global store",
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

// TestCommandCostIndependentOfIdentities checks that identity/allocate and
// identity/get of one identity do not cost more when the node holds many
// others: they used to list every identity to find the reference count.
// Memory allocated per command is the deterministic measure (listing
// allocates per identity); time is compared too, with a wide margin.
func TestCommandCostIndependentOfIdentities(t *testing.T) {
	const many = 20_000
	target := cidr("192.168.7.7/32")
	cost := func(others int) (bytes float64, fastest time.Duration) {
		a := newIdentityAllocator(DefaultConfig, slog.New(slog.DiscardHandler), nil, nil, nil, nil, identity.MaxLocalIdentity)
		if err := a.startStandalone(t.Context()); err != nil {
			t.Fatal(err)
		}
		defer a.stopStandalone(context.Background())
		id, _ := mustAlloc(t, a, target)
		for _, s := range cidrSets(others) {
			mustAlloc(t, a, s)
		}
		settle(a)
		e := script.Engine{Cmds: map[string]script.Cmd{}}
		for _, c := range newCommands(a).ScriptCmds {
			e.Cmds[c.Name] = c.Cmd
		}
		s, err := script.NewState(t.Context(), t.TempDir(), nil)
		if err != nil {
			t.Fatal(err)
		}
		lines := []string{
			"identity/allocate -o json cidr:192.168.7.7/32",
			"identity/get cidr:192.168.7.7/32",
			fmt.Sprintf("identity/get %d", id.ID),
		}
		run := func() time.Duration {
			start := time.Now()
			for _, line := range lines {
				if err := e.ExecuteLine(s, line, io.Discard); err != nil {
					t.Fatalf("%s: %v", line, err)
				}
			}
			return time.Since(start)
		}
		run()
		const runs = 50
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		fastest = time.Hour
		for range runs {
			fastest = min(fastest, run())
		}
		runtime.ReadMemStats(&after)
		return float64(after.TotalAlloc-before.TotalAlloc) / runs, fastest
	}
	fewBytes, fewTime := cost(0)
	manyBytes, manyTime := cost(many)
	t.Logf("per round of 3 commands: %.0f B and %v with 1 identity, %.0f B and %v with %d", fewBytes, fewTime, manyBytes, manyTime, many+1)
	if manyBytes > 2*fewBytes+4096 {
		t.Errorf("with %d identities a round of commands allocates %.0f B, with 1 %.0f B: it works through the other identities", many+1, manyBytes, fewBytes)
	}
	if manyTime > 10*fewTime+time.Millisecond {
		t.Errorf("with %d identities a round of commands takes %v, with 1 %v: it works through the other identities", many+1, manyTime, fewTime)
	}
}
