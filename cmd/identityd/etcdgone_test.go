package main

import (
	"bytes"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/identityd/identityd/internal/etcdtest"
)

// TestStopWithEtcdGone runs the agent as a process on an external etcd with
// the default --kvstore-request-timeout, allocates global identities (so
// that it holds a lease and reference keys), kills etcd and stops the agent
// with SIGTERM: the stop must end within seconds, not wait a request
// timeout per etcd call. The lease's TTL removes the node's references.
func TestStopWithEtcdGone(t *testing.T) {
	if testing.Short() {
		t.Skip("starts etcd and an agent process")
	}
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	dir := t.TempDir()
	var logs bytes.Buffer
	cmd := agentCmd(t, "--state-dir", dir, "--ipcache-map", "file", "--log-format", "json",
		"--prometheus-serve-addr", "127.0.0.1:0", "--kvstore-endpoints", strings.Join(c.Endpoints(), ","))
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	exited := false
	t.Cleanup(func() {
		if !exited {
			cmd.Process.Kill()
			<-done
		}
	})

	deadline := time.Now().Add(time.Minute)
	for i := 0; i < 5; {
		out, err := run(t, "shell", "--state-dir", dir, "--", "identity/allocate", fmt.Sprintf("k8s:app=web-%d", i))
		if err == nil {
			i++
			continue
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent did not allocate: %v\n%s\nlogs:\n%s", err, out, logs.String())
		}
		time.Sleep(200 * time.Millisecond)
	}

	c.Member(0).Kill()
	start := time.Now()
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	// Generous for a loaded machine, yet far below one request timeout
	// (30s by default), let alone one per etcd call.
	const bound = 10 * time.Second
	select {
	case err := <-done:
		exited = true
		took := time.Since(start)
		t.Logf("stopped %s after SIGTERM with etcd gone (exit: %v)", took.Round(time.Millisecond), err)
		if took > bound || err != nil {
			t.Fatalf("stop took %s with etcd gone (want under %s), exit: %v\nlogs:\n%s", took, bound, err, logs.String())
		}
	case <-time.After(3 * time.Minute):
		t.Fatalf("agent did not stop within 3m of SIGTERM with etcd gone\nlogs:\n%s", logs.String())
	}
	for _, msg := range []string{"Revoking the node's etcd lease failed", "Stopped hive"} {
		if !strings.Contains(logs.String(), `"msg":"`+msg) {
			t.Fatalf("no %q in the JSON logs:\n%s", msg, logs.String())
		}
	}
}
