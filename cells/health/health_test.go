package health_test

import (
	"bufio"
	"context"
	"errors"
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/hive/script"
	"go.uber.org/goleak"

	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/internal/testhive"
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
	// A scope closed while Degraded (a job that failed for good) stays so.
	c.Close()
	c.OK("late report from a closed scope")
	if ok, bad := p.Healthy(); ok || len(bad) != 1 || bad[0].Name != "a.c" || bad[0].Message != "broken" {
		t.Fatalf("after closing a degraded scope: %v %+v", ok, bad)
	}
	// A scope of the same name replaces the old one; the old one's Close
	// does not touch the new one.
	c2 := a.NewScope("c")
	c2.OK("again")
	b2 := a.NewScope("b")
	b.Close()
	if n := len(p.All()); n != 3 {
		t.Fatalf("%d scopes, want a and the new a.b and a.c:\n%s", n, health.Format(p.All()))
	}
	if ok, bad := p.Healthy(); ok || bad[0].Name != "a.b" || bad[0].Level != cell.StatusUnknown {
		t.Fatalf("new a.b not reported yet: %+v", bad)
	}
	// A closed scope that was OK is done: Stopped, its message kept, and
	// its parent stays OK although nothing below it runs any more.
	b2.OK("finished")
	b2.Close()
	c2.Close()
	got = health.Format(p.All())
	want = `a: level=OK message=""
a.b: level=Stopped message="finished"
a.c: level=Stopped message="again"
`
	if got != want {
		t.Fatalf("after closing: got\n%s\nwant\n%s", got, want)
	}
	b3 := a.NewScope("b")
	b3.Stopped("done")
	if ok, _ := p.Healthy(); !ok {
		t.Fatal("stopped is healthy")
	}
	p.Root().Degraded("root", nil)
	if ok, bad := p.Healthy(); ok || bad[0].Name != "(root)" {
		t.Fatalf("root report: %+v", bad)
	}
}

// Finished one-shot jobs leave their module OK for good: hive closes a job's
// scope when it returns, and a module that ran only such jobs must not turn
// Unknown (which failed /healthz once a restoration's grace period ended).
// A job that failed for good keeps its module Degraded.
func TestFinishedJobsLeaveModuleOK(t *testing.T) {
	var p *health.Provider
	opts := hive.DefaultOptions()
	opts.ModuleDecorators = health.ModuleDecorators
	finished := make(chan struct{}, 3)
	oneShot := func(name string, err error) job.Job {
		return job.OneShot(name, func(ctx context.Context, h cell.Health) error {
			defer func() { finished <- struct{}{} }()
			h.OK("working")
			return err
		})
	}
	h := hive.NewWithOptions(opts,
		health.Cell, job.Cell,
		cell.Invoke(func(x *health.Provider) { p = x }),
		cell.Module("done", "Only finished jobs",
			cell.Invoke(func(r job.Registry, h cell.Health) {
				r.NewGroup(h).Add(oneShot("first", nil), oneShot("second", nil))
			}),
		),
		cell.Module("failed", "A failed job",
			cell.Invoke(func(r job.Registry, h cell.Health) {
				r.NewGroup(h).Add(oneShot("broken", errors.New("boom")))
			}),
		),
	)
	testhive.Start(t, h)
	for range 3 {
		<-finished
	}
	// The job's scope closes right after its function returns.
	var bad []health.Status
	for range 500 {
		var ok bool
		if ok, bad = p.Healthy(); !ok && len(bad) == 1 && bad[0].Name == "failed.job-broken" && bad[0].Level == cell.StatusDegraded {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	all := health.Format(p.All())
	if len(bad) != 1 || bad[0].Name != "failed.job-broken" || bad[0].Level != cell.StatusDegraded {
		t.Fatalf("want only the failed job at fault, got %+v\n%s", bad, all)
	}
	for _, want := range []string{
		`done: level=OK message=""`,
		`done.job-first: level=Stopped message="Finished (`,
		`done.job-second: level=Stopped message="Finished (`,
		`failed: level=Degraded`,
	} {
		if !strings.Contains(all, want) {
			t.Errorf("no %q in\n%s", want, all)
		}
	}
}

// Live ignores scopes Degraded for a cause marked External; Healthy does
// not.
func TestLiveIgnoresExternalCauses(t *testing.T) {
	p := health.NewProvider()
	kv := p.Root().NewScope("kvstore")
	kv.OK("connected")
	conn := kv.NewScope("job-etcd-connectivity")
	conn.Degraded("etcd does not answer", health.External(errors.New("context deadline exceeded")))
	ready, notReady := p.Healthy()
	live, dead := p.Live()
	if ready || len(notReady) != 1 || !notReady[0].External || !live || len(dead) != 0 {
		t.Fatalf("external cause: ready %v %+v, live %v %+v", ready, notReady, live, dead)
	}
	if got := health.Format(notReady); got != `kvstore.job-etcd-connectivity: level=Degraded message="etcd does not answer" error="context deadline exceeded" cause=external`+"\n" {
		t.Errorf("format: %s", got)
	}
	if err := health.External(errors.New("x")); !errors.Is(err, health.ErrExternal) || err.Error() != "x" {
		t.Errorf("External: %v", err)
	}
	// A report of the agent's own fault counts for both, and so does an
	// Unknown scope.
	own := p.Root().NewScope("checkpoint")
	own.Degraded("write failed", errors.New("disk full"))
	if live, dead := p.Live(); live || len(dead) != 1 || dead[0].Name != "checkpoint" {
		t.Fatalf("own fault: %v %+v", live, dead)
	}
	own.OK("wrote")
	p.Root().NewScope("restoration")
	if live, dead := p.Live(); live || len(dead) != 1 || dead[0].Level != cell.StatusUnknown {
		t.Fatalf("unknown: %v %+v", live, dead)
	}
	// OK again: the mark goes with the report.
	p.Root().NewScope("restoration").OK("done")
	conn.OK("etcd answers")
	if ready, bad := p.Healthy(); !ready {
		t.Fatalf("after recovery: %+v", bad)
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
	testhive.Start(t, h)

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
