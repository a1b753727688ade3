package main

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

	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/cells/shell"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/robustness"
)

// healthAgent is an identityd process with its log in a file, probed over
// HTTP and driven over its shell socket.
type healthAgent struct {
	t       *testing.T
	dir     string
	logPath string
	cmd     *exec.Cmd
	addr    string // metrics and health endpoint
}

func startHealthAgent(t *testing.T, args ...string) *healthAgent {
	t.Helper()
	return startHealthAgentIn(t, filepath.Join(t.TempDir(), "state"), args...)
}

// startHealthAgentIn is startHealthAgent on the state directory dir, which
// a restarted agent reuses.
func startHealthAgentIn(t *testing.T, dir string, args ...string) *healthAgent {
	t.Helper()
	return startWrappedAgent(t, dir, nil, args...)
}

// startWrappedAgent is startHealthAgentIn with the agent's command changed
// by wrap (run under a shell that lowers its limits, say) before it starts.
func startWrappedAgent(t *testing.T, dir string, wrap func(*exec.Cmd), args ...string) *healthAgent {
	t.Helper()
	a := &healthAgent{t: t, dir: dir}
	a.logPath = filepath.Join(t.TempDir(), "agent.log")
	logf, err := os.Create(a.logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	a.cmd = agentCmd(t, append([]string{"--state-dir", a.dir, "--ipcache-map", "file",
		"--prometheus-serve-addr", "127.0.0.1:0", "--log-format", "json"}, args...)...)
	if wrap != nil {
		wrap(a.cmd)
	}
	a.cmd.Stdout, a.cmd.Stderr = logf, logf
	a.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := a.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		a.cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { a.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			a.cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			t.Logf("agent log:\n%s", a.log())
		}
	})
	// The endpoint's port is the kernel's choice: the log names it.
	deadline := time.Now().Add(60 * time.Second)
	for a.addr == "" {
		if time.Now().After(deadline) {
			t.Fatalf("no metrics address in the log:\n%s", a.log())
		}
		time.Sleep(50 * time.Millisecond)
		sc := bufio.NewScanner(strings.NewReader(a.log()))
		for sc.Scan() {
			var line struct{ Msg, Address string }
			if json.Unmarshal(sc.Bytes(), &line) == nil && line.Msg == "Serving metrics and health" {
				a.addr = line.Address
			}
		}
	}
	return a
}

func (a *healthAgent) log() string {
	b, _ := os.ReadFile(a.logPath)
	return string(b)
}

// probe returns the status code and body of a GET of path; code 0 when the
// request itself failed.
func (a *healthAgent) probe(path string) (int, string) {
	c := http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get("http://" + a.addr + path)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// waitFor probes path until it answers code, and returns how long that took.
func (a *healthAgent) waitFor(path string, code int, within time.Duration) (time.Duration, string) {
	a.t.Helper()
	start := time.Now()
	for {
		got, body := a.probe(path)
		if got == code {
			return time.Since(start), body
		}
		if time.Since(start) > within {
			a.t.Fatalf("%s answered %d, not %d, for %s:\n%s", path, got, code, within, body)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (a *healthAgent) dial() *robustness.Shell {
	a.t.Helper()
	sh, err := robustness.DialShell(filepath.Join(a.dir, shell.SocketName), 5*time.Second)
	if err != nil {
		a.t.Fatal(err)
	}
	return sh
}

// TestHealthzPastGracePeriodUnderLoad probes /healthz and /readyz of a
// running agent from its start until well past the restoration's grace
// period, while 8 shell clients allocate and release local and global
// identities for four grace periods: once the agent has started, every probe must
// answer 200. (When a finished job's health scope vanished, restoration
// turned Unknown as its grace period ended and /healthz stayed 503, so
// that a liveness probe restarted the agent in a loop.)
func TestHealthzPastGracePeriodUnderLoad(t *testing.T) {
	parallelProcess(t)
	if testing.Short() {
		t.Skip("runs an agent process under load for 20 seconds")
	}
	const (
		grace   = 5 * time.Second
		load    = 4 * grace
		clients = 8
	)
	a := startHealthAgent(t, "--identity-restore-grace-period", grace.String())
	a.waitFor("/healthz", http.StatusOK, 60*time.Second)
	started := time.Now()

	stop := make(chan struct{})
	var (
		wg         sync.WaitGroup
		mu         sync.Mutex
		failures   []string
		ops        int
		probes     int
		opFailures int
	)
	for w := range clients {
		wg.Go(func() {
			sh := a.dial()
			defer sh.Close()
			sets := [][]string{
				{fmt.Sprintf("cidr:10.%d.0.0/16", w), "reserved:world"},
				{fmt.Sprintf("k8s:app=load%d", w%4), "k8s:io.kubernetes.pod.namespace=health"},
			}
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				out, err := sh.Run(time.Now().Add(30*time.Second), append([]string{"identity/allocate", "-o", "json"}, sets[i%len(sets)]...)...)
				type entry struct {
					Identity struct {
						ID uint32 `json:"id"`
					} `json:"identity"`
				}
				var entries []entry
				if err == nil {
					if entries, err = robustness.DecodeList[entry](out); err == nil && len(entries) != 1 {
						err = fmt.Errorf("%d identities in %q", len(entries), out)
					}
				}
				if err == nil {
					_, err = sh.Run(time.Now().Add(30*time.Second), "identity/release", fmt.Sprint(entries[0].Identity.ID))
				}
				mu.Lock()
				ops++
				if err != nil {
					opFailures++
					if opFailures <= 3 {
						t.Logf("client %d: %v (%s)", w, err, out)
					}
				}
				mu.Unlock()
				if _, broken := err.(*robustness.CommandError); err != nil && !broken {
					return
				}
			}
		})
	}
	for time.Since(started) < load {
		for _, path := range []string{"/healthz", "/readyz"} {
			code, body := a.probe(path)
			probes++
			if code != http.StatusOK {
				failures = append(failures, fmt.Sprintf("%s at %s: %d %s", path, time.Since(started).Round(time.Millisecond), code, body))
			}
		}
		time.Sleep(250 * time.Millisecond)
	}
	close(stop)
	wg.Wait()

	sh := a.dial()
	defer sh.Close()
	status, err := sh.Run(time.Now().Add(10*time.Second), "identity/restore-status", "-o", "json")
	if err != nil || !strings.Contains(status, `"state": "released"`) {
		t.Errorf("restoration did not release after its grace period: %v\n%s", err, status)
	}
	healthOut, err := sh.Run(time.Now().Add(10*time.Second), "health")
	if err != nil || !strings.Contains(healthOut, "restoration.job-restore-grace-period: level=Stopped") {
		t.Errorf("health after the grace period: %v\n%s", err, healthOut)
	}
	t.Logf("%d probes over %s (grace period %s), %d allocate+release rounds by %d clients, %d failed",
		probes, time.Since(started).Round(time.Second), grace, ops, clients, opFailures)
	if ops < clients {
		t.Errorf("only %d rounds of load", ops)
	}
	if opFailures > 0 {
		t.Errorf("%d rounds failed", opFailures)
	}
	if len(failures) > 0 {
		t.Fatalf("%d of %d probes failed; first ones:\n%s", len(failures), probes, strings.Join(failures[:min(len(failures), 5)], "\n"))
	}
}

// TestHealthWhileExternalEtcdDown kills the agent's external etcd and starts
// it again: within a few seconds the kvstore shows Degraded (cause
// external) on /readyz (503), /healthz and the health command, while
// /healthz stays 200 throughout; once etcd is back, both are 200 and global
// allocations work again. (Health used to say OK until the lease expired,
// minutes later, while every global allocation failed.)
func TestHealthWhileExternalEtcdDown(t *testing.T) {
	if testing.Short() {
		t.Skip("runs etcd and agent processes")
	}
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	a := startHealthAgent(t, "--kvstore-endpoints", strings.Join(etcd.Endpoints(), ","),
		"--identity-restore-grace-period", "1s", "--kvstore-request-timeout", "2s",
		"--identity-allocation-timeout", "4s")
	a.waitFor("/readyz", http.StatusOK, 60*time.Second)
	sh := a.dial()
	defer sh.Close()
	// Each label set is new to the node, so that the allocation needs etcd.
	n := 0
	allocate := func() error {
		n++
		app := fmt.Sprintf("k8s:app=web%d", n)
		out, err := sh.Run(time.Now().Add(30*time.Second), "identity/allocate", "k8s:io.kubernetes.pod.namespace=health", app)
		if err == nil && !strings.Contains(out, app) {
			err = fmt.Errorf("unexpected answer %q", out)
		}
		return err
	}
	if err := allocate(); err != nil {
		t.Fatal(err)
	}

	etcd.Member(0).Kill()
	killed := time.Now()
	took, body := a.waitFor("/readyz", http.StatusServiceUnavailable, 30*time.Second)
	const bound = 10 * time.Second // "a few seconds", with room for a loaded machine
	if took > bound {
		t.Errorf("/readyz turned 503 %s after etcd died, want within %s", took, bound)
	}
	if !strings.Contains(body, "kvstore.job-etcd-connectivity: level=Degraded") || !strings.Contains(body, "cause=external") {
		t.Errorf("/readyz does not name the kvstore:\n%s", body)
	}
	t.Logf("/readyz turned 503 %s after etcd was killed", took.Round(time.Millisecond))
	out, err := sh.Run(time.Now().Add(10*time.Second), "health")
	if err == nil || !strings.Contains(out, "kvstore: level=Degraded") {
		t.Errorf("health command with etcd down: %v\n%s", err, out)
	}
	if err := allocate(); err == nil {
		t.Error("a global allocation succeeded with etcd down")
	}
	// Liveness stays: the agent's own work runs, and a restart would not
	// bring etcd back. It shows the kvstore's state all the same.
	for time.Since(killed) < took+5*time.Second {
		code, body := a.probe("/healthz")
		if code != http.StatusOK {
			t.Fatalf("/healthz %d with etcd down:\n%s", code, body)
		}
		if !strings.Contains(body, "kvstore: level=Degraded") {
			t.Fatalf("/healthz does not show the kvstore Degraded:\n%s", body)
		}
		time.Sleep(250 * time.Millisecond)
	}

	etcd.Member(0).Restart()
	back, _ := a.waitFor("/readyz", http.StatusOK, 30*time.Second)
	t.Logf("/readyz turned 200 %s after etcd served again", back.Round(time.Millisecond))
	// Readiness follows the store within a second or two of its return.
	if back > 2*time.Second {
		t.Errorf("/readyz turned 200 %s after etcd returned, want within 2s", back)
	}
	if code, body := a.probe("/healthz"); code != http.StatusOK || !strings.Contains(body, "kvstore.job-etcd-connectivity: level=OK") {
		t.Errorf("/healthz after etcd returned: %d\n%s", code, body)
	}
	if err := allocate(); err != nil {
		t.Errorf("global allocation after etcd returned: %v", err)
	}
}

// TestHealthListsJobs starts the agent and checks that the long-running
// loops of the kvstore (the lease keepalive), the shell (accepting
// connections) and the metrics endpoint (serving HTTP) run as jobs, each
// with its health scope OK in the health command and on /healthz, which
// stays 200 with them.
func TestHealthListsJobs(t *testing.T) {
	parallelProcess(t)
	if testing.Short() {
		t.Skip("runs an agent process")
	}
	scopes := []string{
		"kvstore.job-" + kvstore.KeepaliveJob,
		"shell.job-" + shell.AcceptJob,
		"metrics.job-" + metrics.ServeJob,
	}
	a := startHealthAgent(t)
	a.waitFor("/healthz", http.StatusOK, 60*time.Second)
	sh := a.dial()
	defer sh.Close()
	// The health command fails while a scope is not OK: wait for start.
	var out string
	deadline := time.Now().Add(60 * time.Second)
	for {
		var err error
		out, err = sh.Run(time.Now().Add(10*time.Second), "health")
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("health not OK within 60s: %v\n%s", err, out)
		}
		time.Sleep(100 * time.Millisecond)
	}
	for _, scope := range scopes {
		if !strings.Contains(out, "\n"+scope+": level=OK") && !strings.HasPrefix(out, scope+": level=OK") {
			t.Errorf("health lists no OK scope %s:\n%s", scope, out)
		}
	}
	// Several probes: the jobs' scopes stay OK while the agent runs.
	for range 5 {
		code, body := a.probe("/healthz")
		if code != http.StatusOK {
			t.Fatalf("/healthz answered %d:\n%s", code, body)
		}
		for _, scope := range scopes {
			if !strings.Contains(body, "\n"+scope+": level=OK") {
				t.Errorf("/healthz lists no OK scope %s:\n%s", scope, body)
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
}
