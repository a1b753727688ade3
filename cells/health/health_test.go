package health_test

import (
	"bufio"
	"context"
	"errors"
	"maps"
	"strings"
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/hive/script"
	"go.uber.org/goleak"

	"github.com/identityd/identityd/cells/health"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestTree(t *testing.T) {
	p := health.NewProvider()
	if ok, _ := p.Healthy(); !ok {
		t.Fatal("empty tree is not healthy")
	}
	a := p.Root().NewScope("a")
	b := a.NewScope("b")
	c := a.NewScope("c")
	b.OK("fine")
	ok, bad := p.Healthy()
	if ok || len(bad) != 1 || bad[0].Name != "a.c" || bad[0].Level != cell.StatusUnknown {
		t.Fatalf("unreported leaf: %v %+v", ok, bad)
	}
	c.Degraded("broken", errors.New("boom"))
	all := p.All()
	got := health.Format(all)
	want := `a: level=Degraded message=""
a.b: level=OK message="fine"
a.c: level=Degraded message="broken" error="boom"
`
	if got != want {
		t.Fatalf("got\n%s\nwant\n%s", got, want)
	}
	c.Close()
	c.OK("late report from a closed scope")
	if ok, bad := p.Healthy(); !ok {
		t.Fatalf("after close: %+v", bad)
	}
	// A scope of the same name replaces the old one; the old one's Close
	// does not remove the new one.
	b2 := a.NewScope("b")
	b.Close()
	if n := len(p.All()); n != 2 {
		t.Fatalf("%d scopes, want a and the new a.b", n)
	}
	b2.Stopped("done")
	if ok, _ := p.Healthy(); !ok {
		t.Fatal("stopped is healthy")
	}
	p.Root().Degraded("root", nil)
	if ok, bad := p.Healthy(); ok || bad[0].Name != "(root)" {
		t.Fatalf("root report: %+v", bad)
	}
}

// The decorators give every module, nested ones included, its own scope,
// and hive's job groups report below it.
func TestModuleScopes(t *testing.T) {
	var p *health.Provider
	opts := hive.DefaultOptions()
	opts.ModuleDecorators = health.ModuleDecorators
	h := hive.NewWithOptions(opts,
		health.Cell, job.Cell,
		cell.Invoke(func(x *health.Provider) { p = x }),
		cell.Module("outer", "Outer",
			cell.Invoke(func(h cell.Health) { h.OK("outer ready") }),
			cell.Module("inner", "Inner",
				cell.Invoke(func(r job.Registry, h cell.Health) {
					g := r.NewGroup(h)
					g.Add(job.OneShot("work", func(ctx context.Context, h cell.Health) error {
						h.OK("working")
						<-ctx.Done()
						return nil
					}))
				}),
			),
		),
	)
	log := hivetest.Logger(t)
	if err := h.Start(log, t.Context()); err != nil {
		t.Fatal(err)
	}
	defer h.Stop(log, context.Background())

	cmds, err := h.ScriptCommands(log)
	if err != nil {
		t.Fatal(err)
	}
	maps.Insert(cmds, maps.All(script.DefaultCmds()))
	e := &script.Engine{Cmds: cmds}
	s, err := script.NewState(t.Context(), t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	// Retried until the job has run and reported.
	err = e.Execute(s, "", bufio.NewReader(strings.NewReader("* health\nstdout '^outer\\.inner\\.job-work: level=OK message=\"working\"'\nstdout '^outer: level=OK message=\"outer ready\"'\n")), &out)
	if err != nil {
		t.Fatalf("%v\n%s\n%s", err, out.String(), health.Format(p.All()))
	}
}
