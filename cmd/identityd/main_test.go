package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/identityd/identityd/internal/testproc"
)

// processParallel is how many tests of this package run at a time unless
// -test.parallel says otherwise. Most tests here run agent, etcd and API
// server processes and spend their time waiting for them (a lease to end,
// a GC period, a restart): go test's default, GOMAXPROCS, would keep two
// such waits at a time on a two-core machine. Tests that measure time
// bounds, file descriptors or goroutines, or need a tmpfs mount or a BPF
// pin, do not call t.Parallel and run alone before the others.
const processParallel = 4

// processSlots admit the parallel tests (parallelProcess), processParallel
// or -test.parallel at a time. The package admits them rather than go
// test's -parallel, which it raises, so that the tests that spend minutes
// waiting out a timeout take no slot: they start as the parallel phase
// starts, not whenever go test's wake-up order lets them, and their wait
// overlaps the others.
var processSlots chan struct{}

// parallelProcess marks t parallel and holds one of processSlots until t
// and its subtests end.
func parallelProcess(t *testing.T) {
	t.Parallel()
	processSlot(t)
}

// processSlot holds one of processSlots until tb ends, for a subtest whose
// parent holds none.
func processSlot(tb testing.TB) {
	processSlots <- struct{}{}
	tb.Cleanup(func() { <-processSlots })
}

// waitingParallel marks t parallel without a slot: for the tests that
// spend most of their time waiting out a lease or a heartbeat timeout.
func waitingParallel(t *testing.T) { t.Parallel() }

// TestMain lets the test binary act as identityd when IDENTITYD_AS_MAIN is
// set (raceAgentCmd). The arguments come as a JSON array in IDENTITYD_ARGV,
// so that they reach main exactly as given (spaces, quotes and all).
func TestMain(m *testing.M) {
	if os.Getenv("IDENTITYD_AS_MAIN") == "1" {
		var args []string
		if err := json.Unmarshal([]byte(os.Getenv("IDENTITYD_ARGV")), &args); err != nil {
			fmt.Fprintf(os.Stderr, "IDENTITYD_ARGV: %s\n", err)
			os.Exit(2)
		}
		os.Args = append([]string{"identityd"}, args...)
		main()
		os.Exit(0)
	}
	flag.Parse()
	parallelSet := false
	flag.Visit(func(f *flag.Flag) { parallelSet = parallelSet || f.Name == "test.parallel" })
	slots := max(processParallel, runtime.GOMAXPROCS(0))
	if parallelSet {
		slots, _ = strconv.Atoi(flag.Lookup("test.parallel").Value.String())
	} else {
		// Every parallel test and script may wait for a slot at once.
		flag.Set("test.parallel", "1000")
	}
	processSlots = make(chan struct{}, max(slots, 1))
	// A whole run needs the binary (every process test): it is linked while the
	// first tests run rather than on the way of the test that needs it.
	if !testing.Short() && flag.Lookup("test.run").Value.String() == "" && flag.Lookup("test.list").Value.String() == "" {
		built.Start()
	}
	goleak.VerifyTestMain(removeBuiltAfter{m})
}

// removeBuiltAfter runs the tests and then waits for the build of the
// binary and removes it, before goleak looks for goroutines the tests left.
type removeBuiltAfter struct{ m *testing.M }

func (r removeBuiltAfter) Run() int {
	code := r.m.Run()
	built.Remove()
	return code
}

// built is the identityd binary that agentBinary builds once per test
// binary, for the tests that run identityd as a process.
var built = testproc.OnceBuild{Build: buildAgent}

// agentBinary returns the path of identityd built from this package as the
// Dockerfile builds the image's (static, -trimpath).
func agentBinary(t *testing.T) string {
	t.Helper()
	return built.Path(t)
}

// buildAgent builds identityd into dir as the image builds it (static,
// -trimpath), so the process tests run the binary the image holds.
func buildAgent(dir string) (string, error) {
	bin := filepath.Join(dir, "identityd")
	cmd, err := dockerfileBuildCmd(bin)
	if err != nil {
		return "", err
	}
	if out, err := testproc.CombinedOutputLocked(cmd); err != nil {
		return "", fmt.Errorf("%v: %w\n%s", cmd.Args, err, out)
	}
	return bin, nil
}

// agentCmd is identityd with args as a process, as users run it: the
// binary built as the image's (agentBinary), with this process's
// environment.
//
// The agents are not race-built: under the race detector an agent takes
// several times the CPU, and the process tests run dozens of them, many
// for minutes. The code they run is race-tested in process, by this
// package's hive and script tests and by each cell's own tests;
// raceAgentCmd runs main itself under the race detector.
func agentCmd(t *testing.T, args ...string) *exec.Cmd {
	cmd := exec.Command(agentBinary(t), args...)
	cmd.Env = os.Environ()
	return cmd
}

// raceAgentCmd is agentCmd with this test binary, built with -race as the
// tests are, running main: for the test of the agent's whole life as a
// process (start, the shell, SIGTERM), whose signal handling and shutdown
// no in-process test runs.
func raceAgentCmd(t *testing.T, args ...string) *exec.Cmd {
	argv, err := json.Marshal(args)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "IDENTITYD_AS_MAIN=1", "IDENTITYD_ARGV="+string(argv))
	return cmd
}

func run(t *testing.T, args ...string) (string, error) {
	var out bytes.Buffer
	cmd := agentCmd(t, args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), err
}

func TestHelpListsEveryCellsFlags(t *testing.T) {
	var out bytes.Buffer
	root := newRootCmd(newHive(), &out, &out)
	root.SetOut(&out)
	root.SetArgs([]string{"--help"})
	if err := root.Execute(); err != nil {
		t.Fatal(err)
	}
	for _, flag := range []string{"--state-dir", "--cluster-id", "--cluster-name", "--max-connected-clusters",
		"--identity-allocation-timeout", "--kvstore-endpoints", "--kvstore-lease-ttl", "--node-name",
		"--identity-checkpoint-interval", "--ipcache-map", "--log-format", "--log-level"} {
		if !strings.Contains(out.String(), flag) {
			t.Errorf("--help does not list %s", flag)
		}
	}
}

// TestHelpStatesOneDefault: every flag's line in --help states its default
// at most once (--node-name's default, the host name, was once printed
// both in words and as the name of the machine that printed it).
func TestHelpStatesOneDefault(t *testing.T) {
	var out bytes.Buffer
	root := newRootCmd(newHive(), &out, &out)
	root.SetOut(&out)
	root.SetArgs([]string{"--help"})
	if err := root.Execute(); err != nil {
		t.Fatal(err)
	}
	seen := false
	for _, l := range strings.Split(out.String(), "\n") {
		if n := strings.Count(l, "(default"); n > 1 {
			t.Errorf("--help states %d defaults: %s", n, l)
		}
		if strings.Contains(l, "--node-name") {
			seen = true
			if !strings.HasSuffix(strings.TrimSpace(l), "(default: host name)") {
				t.Errorf("--help's --node-name line does not end in its default, the host name: %s", l)
			}
		}
	}
	if !seen {
		t.Error("--help does not list --node-name")
	}
}

func TestHiveAndVersionCommands(t *testing.T) {
	parallelProcess(t)
	out, err := run(t, "hive")
	if err != nil || !strings.Contains(out, "allocator (Security identity allocator)") || !strings.Contains(out, "Start hooks:") {
		t.Fatalf("hive: %v\n%s", err, out)
	}
	// In crd mode the hive has the Kubernetes client and the CRD store;
	// printing it reads no kubeconfig and reaches no server.
	out, err = run(t, "hive", "--identity-allocation-mode=crd")
	if err != nil || !strings.Contains(out, "crdstore (Global identities in Kubernetes CRD objects)") ||
		!strings.Contains(out, "k8s-client (Kubernetes API client)") {
		t.Fatalf("hive in crd mode: %v\n%s", err, out)
	}
	out, err = run(t, "hive", "dot-graph")
	if err != nil || !strings.Contains(out, "digraph") {
		t.Fatalf("hive dot-graph: %v\n%.300s", err, out)
	}
	out, err = run(t, "version")
	if err != nil || !strings.HasPrefix(out, "identityd ") {
		t.Fatalf("version: %v %q", err, out)
	}
}

func TestStartErrorIsOneLine(t *testing.T) {
	parallelProcess(t)
	file := filepath.Join(t.TempDir(), "file")
	os.WriteFile(file, nil, 0o600)
	out, err := run(t, "--state-dir", file, "--log-level", "error")
	if err == nil {
		t.Fatal("start on a file as state directory succeeded")
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	last := lines[len(lines)-1]
	if !strings.HasPrefix(last, "identityd: ") || !strings.Contains(last, "not a directory") {
		t.Fatalf("last line %q, want one readable error line; output:\n%s", last, out)
	}
	out, err = run(t, "--log-format", "xml")
	if err == nil || !strings.Contains(out, `invalid --log-format "xml"`) {
		t.Fatalf("bad log format: %v %q", err, out)
	}
}

// TestInvalidPolicyCIDRMatchMode: the agent refuses to start with a
// --policy-cidr-match-mode other than Cilium's "nodes", instead of
// numbering remote nodes by a mode it does not know.
func TestInvalidPolicyCIDRMatchMode(t *testing.T) {
	parallelProcess(t)
	var out bytes.Buffer
	cmd := agentCmd(t, "--state-dir", t.TempDir(), "--log-level", "error", "--policy-cidr-match-mode", "pods")
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	var err error
	select {
	case err = <-done:
	case <-time.After(time.Minute):
		cmd.Process.Kill()
		<-done
		t.Fatalf("the agent started with --policy-cidr-match-mode=pods:\n%s", out.String())
	}
	if err == nil || !strings.Contains(out.String(), `invalid --policy-cidr-match-mode "pods": the only mode is "nodes"`) {
		t.Fatalf("--policy-cidr-match-mode=pods: %v %q", err, out.String())
	}
}

// TestSignalStopsCleanly runs the agent as a process on the embedded etcd,
// under the race detector (raceAgentCmd), reaches it through the shell,
// and stops it with SIGTERM.
func TestSignalStopsCleanly(t *testing.T) {
	parallelProcess(t)
	if testing.Short() {
		t.Skip("starts an agent process")
	}
	dir := t.TempDir()
	var logs bytes.Buffer
	cmd := raceAgentCmd(t, "--state-dir", dir, "--ipcache-map", "file", "--log-format", "json", "--prometheus-serve-addr", "127.0.0.1:0")
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	var out string
	deadline := time.Now().Add(60 * time.Second)
	for {
		o, err := run(t, "shell", "--state-dir", dir, "--", "identity/allocate", "cidr:10.0.0.0/8", "reserved:world")
		if err == nil {
			out = o
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent did not answer: %v\n%s\nlogs:\n%s", err, o, logs.String())
		}
		time.Sleep(200 * time.Millisecond)
	}
	if !strings.Contains(out, "16777217") {
		t.Fatalf("allocate through the shell: %q", out)
	}
	// A second agent on the same state directory fails clearly.
	o, err := run(t, "--state-dir", dir, "--ipcache-map", "file", "--log-level", "error", "--prometheus-serve-addr", "127.0.0.1:0")
	if err == nil || !strings.Contains(o, "state directory is in use") {
		t.Fatalf("second agent: %v %q", err, o)
	}
	cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("agent exited with %v\n%s", err, logs.String())
		}
	case <-time.After(60 * time.Second):
		t.Fatalf("agent did not stop on SIGTERM\n%s", logs.String())
	}
	if !strings.Contains(logs.String(), `"msg":"Stopped hive"`) {
		t.Fatalf("no clean stop in the JSON logs:\n%s", logs.String())
	}
	if _, err := os.Stat(filepath.Join(dir, "identityd.sock")); !os.IsNotExist(err) {
		t.Fatal("shell socket left behind after stop")
	}
}
