package main

import (
	"bufio"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/identityd/identityd/cells/shell"
)

// TestAbandonedShellCommandsEnd runs the agent as a process and opens
// shell connections that start a command that never ends by itself
// (db/watch) and then go away, as a probe or a script killed by its
// timeout does: the agent ends those commands, so its goroutines come back
// to what they were instead of growing with every abandoned connection.
func TestAbandonedShellCommandsEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("starts an agent process")
	}
	a := startHealthAgent(t)
	goroutines := func() int {
		t.Helper()
		_, body := a.probe("/metrics")
		for _, line := range strings.Split(body, "\n") {
			if v, ok := strings.CutPrefix(line, "go_goroutines "); ok {
				n, err := strconv.ParseFloat(v, 64)
				if err == nil {
					return int(n)
				}
			}
		}
		t.Fatalf("no go_goroutines in /metrics:\n%s", body)
		return 0
	}
	a.waitFor("/readyz", 200, 60*time.Second)
	sock := filepath.Join(a.dir, shell.SocketName)
	// One connection first, so that what the shell keeps running between
	// commands is in the baseline.
	abandon := func() {
		t.Helper()
		conn, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		if _, err := conn.Write([]byte(`["db/watch","identities"]` + "\n")); err != nil {
			t.Fatal(err)
		}
		conn.SetReadDeadline(time.Now().Add(30 * time.Second))
		if line, err := bufio.NewReader(conn).ReadString('\n'); err != nil || !strings.Contains(line, "output") {
			t.Fatalf("db/watch's first answer: %q, %v", line, err)
		}
	}
	settled := func(limit int) (int, bool) {
		deadline := time.Now().Add(15 * time.Second)
		for {
			n := goroutines()
			if n <= limit {
				return n, true
			}
			if time.Now().After(deadline) {
				return n, false
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	abandon()
	time.Sleep(time.Second)
	base := goroutines()

	const abandoned = 30
	for range abandoned {
		abandon()
	}
	// Some slack for the agent's own jobs; each abandoned db/watch that
	// kept running would hold at least one goroutine.
	n, ok := settled(base + abandoned/3)
	if !ok {
		t.Fatalf("%d goroutines 15s after %d abandoned db/watch connections, %d before", n, abandoned, base)
	}
	t.Logf("%d goroutines after %d abandoned db/watch connections, %d before", n, abandoned, base)
}
