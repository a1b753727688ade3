package robustness

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/k8stest"
)

// injector injects faults one at a time, each followed by its repair, so
// that the cluster always comes back to health and the run can go on.
type injector struct {
	t *testing.T
	c *etcdtest.Cluster
	// api is the Kubernetes API server in CRD mode, nil otherwise.
	api    *k8stest.Server
	agents []*agent
	h      *History
	sets   []labelSet
	rng    *rand.Rand
	// lastFault is when the last fault was repaired.
	lastFault time.Time
}

// run injects faults of the given kinds in random order until until. The
// first round holds every kind and always completes, so that even a short
// run tests each of them.
func (inj *injector) run(kinds []EventKind, until time.Time) {
	// Let the workload take references first: the checker only verifies
	// local label sets held for settle before an agent's kill.
	time.Sleep(settle + time.Second)
	for round := 0; ; round++ {
		inj.rng.Shuffle(len(kinds), func(i, j int) { kinds[i], kinds[j] = kinds[j], kinds[i] })
		for _, k := range kinds {
			gap := inj.between(500*time.Millisecond, 1500*time.Millisecond)
			// A fault with its repair takes a few seconds.
			if round > 0 && time.Now().Add(gap+8*time.Second).After(until) {
				return
			}
			time.Sleep(gap)
			if inj.t.Failed() {
				return
			}
			inj.inject(k)
		}
	}
}

func (inj *injector) between(lo, hi time.Duration) time.Duration {
	return lo + time.Duration(inj.rng.Int64N(int64(hi-lo)+1))
}

func (inj *injector) inject(kind EventKind) {
	t, c := inj.t, inj.c
	e := Event{Kind: kind, Start: time.Now()}
	switch kind {
	case EtcdKill:
		m := c.Member(inj.rng.IntN(len(c.Members())))
		e.Target = m.Name()
		m.Kill()
		time.Sleep(inj.between(time.Second, 2*time.Second))
		m.Restart()
		c.WaitLeader(t)
	case EtcdPause:
		m := c.Member(inj.rng.IntN(len(c.Members())))
		e.Target = m.Name()
		m.Pause()
		time.Sleep(inj.between(1500*time.Millisecond, 3*time.Second))
		m.Resume()
		c.WaitLeader(t)
	case EtcdRestartAll:
		e.Target = "etcd"
		for _, m := range c.Members() {
			m.Kill()
		}
		time.Sleep(inj.between(500*time.Millisecond, 1500*time.Millisecond))
		c.RestartAll()
	case APIServerRestart:
		e.Target = "apiserver"
		inj.api.Restart(t)
	case APIServerKill:
		e.Target = "apiserver"
		inj.api.Kill(t)
		time.Sleep(inj.between(500*time.Millisecond, 1500*time.Millisecond))
		// Restart starts it again: there is nothing left to stop.
		inj.api.Restart(t)
	case NodeKill:
		inj.killAgent(inj.agents[inj.rng.IntN(len(inj.agents))])
		return
	}
	e.End = time.Now()
	inj.h.AddEvent(e)
	inj.lastFault = e.End
}

// killAgent kills an agent with SIGKILL, starts it again on the same state
// directory, and allocates every local label set once more (and releases
// it): the checker compares the numbers with those held before the kill.
func (inj *injector) killAgent(a *agent) {
	t := inj.t
	kill := Event{Kind: NodeKill, Target: a.name, Start: time.Now()}
	a.kill()
	kill.End = time.Now()
	inj.h.AddEvent(kill)
	time.Sleep(inj.between(200*time.Millisecond, time.Second))
	ready := Event{Kind: NodeReady, Target: a.name, Start: time.Now()}
	if err := a.start(); err != nil {
		t.Fatal(err)
	}
	ready.End = time.Now()
	inj.h.AddEvent(ready)
	inj.lastFault = ready.End

	sh, err := DialShell(a.socket(), time.Second)
	if err != nil {
		t.Fatalf("shell of %s after its restart: %v", a.name, err)
	}
	defer sh.Close()
	for _, set := range inj.sets {
		if set.global {
			continue
		}
		op, ok := do(sh, inj.h, a.name, OpAllocate, set, 0)
		if !ok {
			a.dumpGoroutines()
			t.Fatalf("allocating %s on %s after its restart: %s (#%d; the agent's goroutines are in its log)", set.args, a.name, op.Err, op.Seq)
		}
		if op.Outcome == OK {
			if op, ok := do(sh, inj.h, a.name, OpRelease, set, op.ID); !ok {
				a.dumpGoroutines()
				t.Fatalf("releasing %s on %s after its restart: %s (#%d; the agent's goroutines are in its log)", set.args, a.name, op.Err, op.Seq)
			}
		}
	}
}
