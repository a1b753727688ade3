package robustness

import (
	"fmt"
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
	"github.com/identityd/identityd/internal/testproc"
	"github.com/identityd/identityd/labels"
)

// Settings of the agents under test, and what the checker derives from
// them.
const (
	// The shortest lease etcd's keys (in CRD mode, the IdentityNode
	// record) of a killed agent outlive it by.
	leaseTTL = 25 * time.Second
	// allocTimeout bounds every allocation or release that waits for etcd;
	// opSlack is what the shell round trip may add on a busy machine. The
	// caller's deadline is their sum.
	allocTimeout = 4 * time.Second
	opSlack      = 4 * time.Second
	// observe is how long past the deadline the client keeps listening, so
	// that a late success is seen instead of cut off.
	observe = 5 * time.Second
	// The checkpoint interval bounds how stale the checkpoint of a killed
	// agent is: settle is what the checker allows for it.
	checkpointInterval = 250 * time.Millisecond
	settle             = 2 * time.Second
	restoreGrace       = 30 * time.Second
)

// buildAgent builds the identityd binary once for the test.
func buildAgent(t *testing.T) string {
	t.Helper()
	bin, err := testproc.BuildAgent(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return bin
}

// agent is one identityd process, restarted on the same state directory
// and node name after each kill.
type agent struct {
	name, dir, bin string
	// storeArgs point the agent at the global store under test.
	storeArgs []string
	logPath   string

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
	up   bool
	// gen counts the processes started: a client that sees it change
	// knows every reference it held was lost.
	gen int
}

func newAgent(t *testing.T, bin, name string, storeArgs []string) *agent {
	dir := filepath.Join(t.TempDir(), name)
	return &agent{name: name, dir: dir, bin: bin, storeArgs: storeArgs, logPath: dir + ".log"}
}

func (a *agent) socket() string { return filepath.Join(a.dir, shell.SocketName) }

func (a *agent) state() (up bool, gen int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.up, a.gen
}

// start runs a new process and waits until its shell answers and its
// restoration is done.
func (a *agent) start() error {
	logf, err := os.OpenFile(a.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	fmt.Fprintf(logf, "=== starting %s at %s\n", a.name, time.Now().Format(time.RFC3339Nano))
	cmd := exec.Command(a.bin, append([]string{
		"--state-dir", a.dir,
		"--node-name", a.name,
		"--ipcache-map", "file",
		"--prometheus-serve-addr", "127.0.0.1:0",
		"--log-level", "info",
		"--identity-allocation-timeout", allocTimeout.String(),
		"--identity-checkpoint-interval", checkpointInterval.String(),
		"--identity-restore-grace-period", restoreGrace.String(),
		// Collect unused global identities often, so that IDs are
		// reused for other label sets during the run.
		"--identity-gc-interval", "3s",
	}, a.storeArgs...)...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	a.mu.Lock()
	a.cmd, a.done = cmd, done
	a.mu.Unlock()

	deadline := time.Now().Add(90 * time.Second)
	for {
		out, err := a.run(5*time.Second, "identity/restore-status", "-o", "json")
		if err == nil && !strings.Contains(out, `"state": "pending"`) && !strings.Contains(out, `"state": "restoring"`) {
			break
		}
		select {
		case <-done:
			return fmt.Errorf("agent %s exited at start; log:\n%s", a.name, tail(a.logPath, 4<<10))
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("agent %s not ready: %v %s; log:\n%s", a.name, err, out, tail(a.logPath, 4<<10))
		}
		time.Sleep(100 * time.Millisecond)
	}
	a.mu.Lock()
	a.up = true
	a.gen++
	a.mu.Unlock()
	return nil
}

// kill sends SIGKILL and waits for the process to be gone.
func (a *agent) kill() { a.end(syscall.SIGKILL) }

// dumpGoroutines ends the agent with SIGQUIT, on which the Go runtime
// writes every goroutine's stack to the agent's log: what a hung command
// waits for.
func (a *agent) dumpGoroutines() { a.end(syscall.SIGQUIT) }

// stop ends the agent with SIGTERM, as an operator would.
func (a *agent) stop() { a.end(syscall.SIGTERM) }

// end sends sig and waits for the process to be gone, killing it after 30 s.
func (a *agent) end(sig syscall.Signal) {
	a.mu.Lock()
	cmd, done := a.cmd, a.done
	a.up = false
	a.mu.Unlock()
	if cmd == nil {
		return
	}
	cmd.Process.Signal(sig)
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		cmd.Process.Signal(syscall.SIGKILL)
		<-done
	}
}

// run runs one command on a connection of its own.
func (a *agent) run(timeout time.Duration, args ...string) (string, error) {
	sh, err := DialShell(a.socket(), timeout)
	if err != nil {
		return "", err
	}
	defer sh.Close()
	return sh.Run(time.Now().Add(timeout), args...)
}

// listEntry is the part of an `identity/list -o json` or
// `identity/allocate -o json` entry the test reads.
type listEntry struct {
	Identity struct {
		ID     identity.NumericIdentity `json:"id"`
		Labels labels.Labels            `json:"labels"`
	} `json:"identity"`
	Source   string `json:"source"`
	RefCount int    `json:"ref-count"`
}

func parseEntries(out string) ([]listEntry, error) { return DecodeList[listEntry](out) }

// heldGlobal returns the global label sets the agent references.
func (a *agent) heldGlobal() (map[string]identity.NumericIdentity, error) {
	out, err := a.run(10*time.Second, "identity/list", "--source", "global", "-o", "json")
	if err != nil {
		return nil, err
	}
	es, err := parseEntries(out)
	if err != nil {
		return nil, err
	}
	held := map[string]identity.NumericIdentity{}
	for _, e := range es {
		if e.RefCount == 0 {
			continue
		}
		// Canonical form needs the labels sorted, which New does.
		lbls, err := labels.New(e.Identity.Labels...)
		if err != nil {
			return nil, fmt.Errorf("labels of identity %d: %w", e.Identity.ID, err)
		}
		held[lbls.Canonical()] = e.Identity.ID
	}
	return held, nil
}

func tail(path string, n int64) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(%v)", err)
	}
	if int64(len(b)) > n {
		b = b[int64(len(b))-n:]
	}
	return string(b)
}
