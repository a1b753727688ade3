package restarttest

import (
	"bytes"
	"fmt"
	"net/netip"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/robustness"
)

// TestProcessRestart runs the identityd binary, fills its ipcache with
// 10,000 CIDR prefixes through the shell, stops it (SIGTERM, then SIGKILL
// with a checkpoint older than the map) and starts it again on the same
// state directory: every prefix -> identity pair of the datapath map must
// be the same.
func TestProcessRestart(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	bin := agentBinary(t)
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGKILL} {
		t.Run(sig.String(), func(t *testing.T) {
			t.Parallel()
			testProcessRestart(t, bin, sig)
		})
	}
}

type proc struct {
	t        *testing.T
	bin, dir string
	cmd      *exec.Cmd
	log      *lockedBuffer
}

// lockedBuffer is the agent's output: the process writes it while a failing
// test prints it.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// startProc starts the agent on dir; extra flags come after the test's
// defaults and override them.
func startProc(t *testing.T, bin, dir string, extra ...string) *proc {
	t.Helper()
	p := &proc{t: t, bin: bin, dir: dir, log: &lockedBuffer{}}
	args := []string{
		"--state-dir", dir, "--ipcache-map=file",
		"--identity-restore-grace-period=1h",
		// The SIGKILL case relies on the map alone for what came after the
		// first checkpoint write.
		"--identity-checkpoint-interval=1h",
	}
	// A fixed metrics port would clash between runs.
	if help, _ := exec.Command(bin, "--help").CombinedOutput(); bytes.Contains(help, []byte("--prometheus-serve-addr")) {
		args = append(args, "--prometheus-serve-addr=127.0.0.1:0")
	}
	args = append(args, extra...)
	p.cmd = exec.Command(bin, args...)
	p.cmd.Stdout, p.cmd.Stderr = p.log, p.log
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if p.cmd.ProcessState == nil {
			p.cmd.Process.Kill()
			p.cmd.Wait()
		}
	})
	deadline := time.Now().Add(time.Minute)
	for {
		out, err := p.shell("identity/restore-status", "-o", "json")
		if err == nil && !strings.Contains(out, `"state": "pending"`) && !strings.Contains(out, `"state": "restoring"`) {
			return p
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent not ready: %v %s\nlog:\n%s", err, out, p.log)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (p *proc) shell(args ...string) (string, error) {
	cmd := exec.Command(p.bin, append([]string{"shell", "--state-dir", p.dir, "--"}, args...)...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func (p *proc) mustShell(args ...string) string {
	p.t.Helper()
	out, err := p.shell(args...)
	if err != nil {
		p.t.Fatalf("shell %s: %s\n%s", args[0], err, out)
	}
	return out
}

// tablePairs returns the ipcache table as prefix -> identity.
func (p *proc) tablePairs() map[netip.Prefix]identity.NumericIdentity {
	p.t.Helper()
	rows, err := parseRows(p.mustShell("ipcache/list", "-o", "json"))
	if err != nil {
		p.t.Fatalf("ipcache/list: %s", err)
	}
	m := make(map[netip.Prefix]identity.NumericIdentity, len(rows))
	for _, r := range rows {
		m[r.Prefix] = r.Identity
	}
	return m
}

// mapDump returns the datapath map as prefix -> identity.
func (p *proc) mapDump() map[netip.Prefix]identity.NumericIdentity {
	p.t.Helper()
	out := p.mustShell("ipcache/map-dump", "-o", "json")
	rows, err := robustness.DecodeList[ipcache.MapRow](out)
	if err != nil {
		p.t.Fatalf("map dump: %s", err)
	}
	m := make(map[netip.Prefix]identity.NumericIdentity, len(rows))
	for _, r := range rows {
		m[r.Prefix] = r.Identity
	}
	return m
}

func (p *proc) stop(sig syscall.Signal) {
	p.t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		p.t.Fatal(err)
	}
	err := p.cmd.Wait()
	if sig == syscall.SIGTERM && err != nil {
		p.t.Fatalf("agent exited with %s\nlog:\n%s", err, p.log)
	}
}

func testProcessRestart(t *testing.T, bin string, sig syscall.Signal) {
	dir := t.TempDir()
	p := startProc(t, bin, dir)
	// A call carries a few hundred prefixes, as an operator's would (a
	// request may be up to shell.MaxRequestBytes, 1 MiB).
	const n, perCall = 10_000, 200
	for c := 0; c < n/perCall; c++ {
		args := []string{"ipcache/upsert"}
		for i := c * perCall; i < (c+1)*perCall; i++ {
			if i%4 == 3 {
				args = append(args, fmt.Sprintf("2001:db8::%x:%x/128", i>>16, i&0xffff))
			} else {
				args = append(args, fmt.Sprintf("10.%d.%d.%d/32", i>>16, (i>>8)&0xff, i&0xff))
			}
		}
		p.mustShell(args...)
		if c == n/perCall/2 && sig == syscall.SIGKILL {
			// The checkpoint holds half of the prefixes; the rest is only
			// in the map when the agent dies.
			p.mustShell("checkpoint/write")
		}
	}
	// Global label sets through the embedded etcd.
	for _, app := range []string{"web", "db", "cache"} {
		p.mustShell("identity/allocate", "k8s:app="+app, "k8s:io.kubernetes.pod.namespace=default")
	}
	// The file backend writes the map at most every 200ms.
	var before map[netip.Prefix]identity.NumericIdentity
	deadline := time.Now().Add(30 * time.Second)
	for {
		before = p.mapDump()
		if len(before) == n || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if len(before) != n {
		t.Fatalf("map has %d entries before the restart, want %d", len(before), n)
	}
	time.Sleep(time.Second)
	p.stop(sig)

	q := startProc(t, bin, dir)
	after := q.mapDump()
	same := 0
	for pfx, id := range before {
		if after[pfx] == id {
			same++
		}
	}
	t.Logf("%s: %d of %d prefix -> identity pairs identical after the restart", sig, same, len(before))
	if same != len(before) || len(after) != len(before) {
		t.Fatalf("%s: %d of %d pairs identical, %d entries after\nstatus: %s", sig, same, len(before), len(after),
			q.mustShell("identity/restore-status", "-o", "json"))
	}
	t.Log(q.mustShell("identity/restore-status"))
	q.stop(syscall.SIGTERM)
}
