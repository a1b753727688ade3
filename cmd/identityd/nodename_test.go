package main

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/k8stest"
)

// TestSameNodeNameRefused runs two agents as processes with one node name
// on one etcd: the second refuses to start and names the first, which
// keeps serving.
func TestSameNodeNameRefused(t *testing.T) {
	parallelProcess(t)
	if testing.Short() {
		t.Skip("starts agent processes")
	}
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	endpoints := strings.Join(c.Endpoints(), ",")
	first := t.TempDir()
	var logs bytes.Buffer
	cmd := agentCmd(t, "--state-dir", first, "--kvstore-endpoints", endpoints, "--node-name", "same",
		"--ipcache-map", "file", "--prometheus-serve-addr", "127.0.0.1:0", "--log-level", "warn")
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	deadline := time.Now().Add(60 * time.Second)
	for {
		if _, err := run(t, "shell", "--state-dir", first, "--", "kvstore/status"); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("first agent did not answer:\n%s", logs.String())
		}
		time.Sleep(200 * time.Millisecond)
	}

	var second bytes.Buffer
	cmd2 := agentCmd(t, "--state-dir", t.TempDir(), "--kvstore-endpoints", endpoints, "--node-name", "same",
		"--ipcache-map", "file", "--prometheus-serve-addr", "127.0.0.1:0", "--log-level", "error")
	cmd2.Stdout, cmd2.Stderr = &second, &second
	if err := cmd2.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd2.Wait() }()
	select {
	case err := <-done:
		out := second.String()
		if err == nil || !strings.Contains(out, `node name is in use by another live agent: --node-name "same" is used by the agent of host`) {
			t.Fatalf("second agent with the same node name: %v\n%s", err, out)
		}
	case <-time.After(60 * time.Second):
		cmd2.Process.Kill()
		<-done
		t.Fatalf("a second agent with the same node name is still running after 60s:\n%s", second.String())
	}
	if o, err := run(t, "shell", "--state-dir", first, "--", "identity/allocate", "k8s:app=still-served"); err != nil {
		t.Fatalf("first agent after the refused start: %v %s", err, o)
	}
}

// TestCRDSameNodeNameRefused is TestSameNodeNameRefused in crd mode: the
// second agent with the name of a running one refuses to start and names
// it; once the first is killed (SIGKILL), an agent with the name takes its
// record over, with the identities the first listed.
func TestCRDSameNodeNameRefused(t *testing.T) {
	parallelProcess(t)
	if testing.Short() {
		t.Skip("runs an API server and agent processes")
	}
	srv := k8stest.Start(t)
	objs := newAPIObjects(t, srv)
	first := startCRDAgent(t, filepath.Join(t.TempDir(), "first"), srv.Kubeconfig(), "same")
	sh := first.dial()
	id := allocate(t, sh, "k8s:app=same-name")
	sh.Close()
	waitUntil(t, 30*time.Second, "the first agent's IdentityNode lists the identity", objs.lists("same", id, true))

	out, err := runAgentToExit(t, append([]string{"--state-dir", t.TempDir(), "--ipcache-map", "file",
		"--prometheus-serve-addr", "", "--log-level", "error"}, crdAgentArgs(srv.Kubeconfig(), "same")...)...)
	want := fmt.Sprintf(`node name is in use by another live agent: --node-name "same" is used by the agent of host %q, pid %d`, hostname(t), first.cmd.Process.Pid)
	if err == nil || !strings.Contains(out, want) {
		t.Fatalf("second agent with the same node name: %v, want %q in:\n%s", err, want, out)
	}
	if o, err := run(t, "shell", "--state-dir", first.dir, "--", "identity/allocate", "k8s:app=still-served"); err != nil {
		t.Fatalf("first agent after the refused start: %v %s", err, o)
	}

	first.stop(syscall.SIGKILL)
	startCRDAgent(t, filepath.Join(t.TempDir(), "second"), srv.Kubeconfig(), "same")
	// The second agent lists what the first did until the first's lease
	// would have ended.
	waitUntil(t, 30*time.Second, "the new agent's record keeps the first's identity", objs.lists("same", id, true))
}

func hostname(t *testing.T) string {
	t.Helper()
	h, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// TestNodeNameCharactersRefused: node names that cannot be an etcd key's
// last element and an object name everywhere (";", spaces) stop the agent
// at start with an error line naming the rule, before it writes anything.
func TestNodeNameCharactersRefused(t *testing.T) {
	parallelProcess(t)
	for _, name := range []string{"a;b", "a b", "node-1 "} {
		dir := filepath.Join(t.TempDir(), "state")
		out, err := runAgentToExit(t, "--state-dir", dir, "--node-name", name, "--log-level", "error")
		want := fmt.Sprintf("--node-name %q may hold only letters, digits, '-', '.' and '_'", name)
		if err == nil || !strings.Contains(out, want) {
			t.Errorf("--node-name %q: %v %q", name, err, out)
		}
		lines := strings.Split(strings.TrimSpace(out), "\n")
		if last := lines[len(lines)-1]; !strings.HasPrefix(last, "identityd: ") || !strings.Contains(last, want) {
			t.Errorf("--node-name %q: last line %q, want the one error line", name, last)
		}
		if _, err := os.Stat(filepath.Join(dir, "etcd")); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("--node-name %q: the embedded etcd's directory exists (%v)", name, err)
		}
	}
}
