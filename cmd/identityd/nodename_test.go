package main

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/identityd/identityd/internal/etcdtest"
)

// TestSameNodeNameRefused runs two agents as processes with one node name
// on one etcd: the second refuses to start and names the first, which
// keeps serving.
func TestSameNodeNameRefused(t *testing.T) {
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
