package modemigration

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/identityd/identityd/cells/shell"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/robustness"
	"github.com/identityd/identityd/internal/testproc"
	"github.com/identityd/identityd/labels"
)

// shellsPerAgent is how many shell connections the test drives an agent
// over at once: the allocations of a restarted node go out in parallel, as
// a node's endpoints come back in parallel.
const shellsPerAgent = 8

// agent is one node: an identityd process, restarted on the same state
// directory and node name in whatever mode the roll has reached.
type agent struct {
	t       *testing.T
	name    string
	dir     string
	bin     string
	logPath string
	// storeArgs returns the flags that point the agent at the stores its
	// mode uses.
	storeArgs func(mode string) []string

	mode   string
	cmd    *exec.Cmd
	done   chan struct{}
	addr   string // metrics and health endpoint
	shells []*robustness.Shell
}

// args are the flags every incarnation of every node shares: collection
// in both stores and the convergence report run often, so that a wrong
// deletion or a difference between the stores shows within the test.
func (a *agent) args(mode string) []string {
	return append([]string{
		"--state-dir", a.dir,
		"--node-name", a.name,
		"--ipcache-map", "file",
		"--prometheus-serve-addr", "127.0.0.1:0",
		"--log-format", "json",
		"--identity-allocation-mode", mode,
		"--identity-gc-interval", "2s",
		"--double-write-metric-reporter-interval", "200ms",
		// The shortest the CRD store allows where no Cilium agent
		// allocates.
		"--identity-heartbeat-timeout", "2m",
		"--identity-gc-cilium-agents=false",
	}, a.storeArgs(mode)...)
}

// start runs a new process in mode and waits until it is ready (its first
// listing of global identities done) and its shells are connected.
func (a *agent) start(mode string) {
	a.t.Helper()
	logf, err := os.OpenFile(a.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		a.t.Fatal(err)
	}
	defer logf.Close()
	fi, err := logf.Stat()
	if err != nil {
		a.t.Fatal(err)
	}
	offset := fi.Size()
	cmd := exec.Command(a.bin, a.args(mode)...)
	cmd.Stdout, cmd.Stderr = logf, logf
	testproc.SetDeathSignal(cmd)
	if err := cmd.Start(); err != nil {
		a.t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	a.mode, a.cmd, a.done, a.addr = mode, cmd, done, ""

	deadline := time.Now().Add(90 * time.Second)
	wait := func(what string) {
		select {
		case <-done:
			a.t.Fatalf("%s (%s) exited before %s:\n%s", a.name, mode, what, testproc.ReadFrom(a.logPath, offset))
		default:
		}
		if time.Now().After(deadline) {
			a.t.Fatalf("%s (%s): no %s within 90s:\n%s", a.name, mode, what, testproc.ReadFrom(a.logPath, offset))
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The endpoint's port is the kernel's choice: the log names it.
	for a.addr == "" {
		sc := bufio.NewScanner(strings.NewReader(testproc.ReadFrom(a.logPath, offset)))
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			var line struct{ Msg, Address string }
			if json.Unmarshal(sc.Bytes(), &line) == nil && line.Msg == "Serving metrics and health" {
				a.addr = line.Address
			}
		}
		if a.addr == "" {
			wait("metrics address in the log")
		}
	}
	for {
		code, _ := a.get("/readyz")
		if code == http.StatusOK {
			break
		}
		wait("/readyz 200")
	}
	a.shells = a.shells[:0]
	for range shellsPerAgent {
		sh, err := robustness.DialShell(filepath.Join(a.dir, shell.SocketName), 10*time.Second)
		if err != nil {
			a.t.Fatalf("%s: shell: %v", a.name, err)
		}
		a.shells = append(a.shells, sh)
	}
}

// stop ends the process with sig and waits for it to be gone. After
// SIGTERM the agent must exit cleanly.
func (a *agent) stop(sig syscall.Signal) {
	a.t.Helper()
	for _, sh := range a.shells {
		sh.Close()
	}
	a.shells = a.shells[:0]
	if a.cmd == nil {
		return
	}
	a.cmd.Process.Signal(sig)
	select {
	case <-a.done:
	case <-time.After(30 * time.Second):
		a.cmd.Process.Kill()
		<-a.done
		a.t.Fatalf("%s (%s) still ran 30s after %s:\n%s", a.name, a.mode, sig, testproc.TailFile(a.logPath, 8<<10))
	}
	if sig == syscall.SIGTERM && !a.cmd.ProcessState.Success() {
		a.t.Fatalf("%s (%s) exited with %s after SIGTERM:\n%s", a.name, a.mode, a.cmd.ProcessState, testproc.TailFile(a.logPath, 8<<10))
	}
	a.cmd = nil
}

// get returns the status code and body of a GET of path on the agent's
// metrics and health endpoint; code 0 when the request failed.
func (a *agent) get(path string) (int, string) {
	c := http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get("http://" + a.addr + path)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// run runs one command on the agent's first shell.
func (a *agent) run(args ...string) (string, error) {
	return a.shells[0].Run(time.Now().Add(time.Minute), args...)
}

// entry is the part of an `identity/list -o json` or `identity/allocate
// -o json` entry the test reads.
type entry struct {
	Identity struct {
		ID     identity.NumericIdentity `json:"id"`
		Labels labels.Labels            `json:"labels"`
	} `json:"identity"`
	RefCount int `json:"ref-count"`
}

func (e entry) canonical() (string, error) {
	// The canonical form needs the labels sorted, which New does.
	lbls, err := labels.New(e.Identity.Labels...)
	if err != nil {
		return "", fmt.Errorf("labels of identity %d: %w", e.Identity.ID, err)
	}
	return lbls.Canonical(), nil
}

// allocateAll allocates every label set of sets on the agent, over all its
// shells at once, and returns each set's ID by canonical form.
func (a *agent) allocateAll(sets []labels.Labels) (map[string]identity.NumericIdentity, error) {
	var (
		mu      sync.Mutex
		got     = make(map[string]identity.NumericIdentity, len(sets))
		first   error
		slowest time.Duration
		next    int
		wg      sync.WaitGroup
	)
	start := time.Now()
	for _, sh := range a.shells {
		wg.Go(func() {
			for {
				mu.Lock()
				if next == len(sets) || first != nil {
					mu.Unlock()
					return
				}
				lbls := sets[next]
				next++
				mu.Unlock()
				args := append([]string{"identity/allocate", "-o", "json"}, lbls.Strings()...)
				t0 := time.Now()
				out, err := sh.Run(time.Now().Add(time.Minute), args...)
				took := time.Since(t0)
				var es []entry
				if err == nil {
					es, err = robustness.DecodeList[entry](out)
				}
				if err == nil && len(es) != 1 {
					err = fmt.Errorf("%d entries", len(es))
				}
				mu.Lock()
				if err != nil {
					if first == nil {
						first = fmt.Errorf("%s: identity/allocate %s: %w\n%s", a.name, lbls.Canonical(), err, out)
					}
				} else {
					got[lbls.Canonical()] = es[0].Identity.ID
				}
				if took > slowest {
					slowest = took
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	a.t.Logf("%s (%s): %d allocations in %s, the slowest %s", a.name, a.mode, len(sets),
		time.Since(start).Round(time.Millisecond), slowest.Round(time.Millisecond))
	return got, first
}

// view is what a node answers for the global label sets it knows: the ID
// of each, and whether the node holds it.
type view struct {
	ids  map[string]identity.NumericIdentity
	held map[string]bool
	// twice lists label sets the node gives two IDs.
	twice []string
}

// list reads the agent's global identities (identity/list, all the node
// knows from its read store, with its own references).
func (a *agent) list() (view, error) {
	out, err := a.run("identity/list", "--source", "global", "-o", "json")
	if err != nil {
		return view{}, fmt.Errorf("%s: identity/list: %w", a.name, err)
	}
	es, err := robustness.DecodeList[entry](out)
	if err != nil {
		return view{}, fmt.Errorf("%s: identity/list: %w", a.name, err)
	}
	v := view{ids: make(map[string]identity.NumericIdentity, len(es)), held: map[string]bool{}}
	for _, e := range es {
		c, err := e.canonical()
		if err != nil {
			return view{}, err
		}
		if old, ok := v.ids[c]; ok && old != e.Identity.ID {
			v.twice = append(v.twice, fmt.Sprintf("%s: %d and %d", c, old, e.Identity.ID))
		}
		v.ids[c] = e.Identity.ID
		if e.RefCount > 0 {
			v.held[c] = true
		}
	}
	return v, nil
}
