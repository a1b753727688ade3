package main

import (
	"net"
	"net/http"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/identityd/identityd/cells/shell"
)

// TestShellConnectionFlood runs the agent with an open-files limit of 200
// and opens 400 shell connections at once: the agent serves an eighth of
// its limit and refuses the rest with an error, /healthz answers 200 during
// the flood, and once the flood's connections are closed a normal shell
// command answers within a second. (Before, the burst took the agent past
// its limit, the accept job failed for good and /healthz stayed 503.)
func TestShellConnectionFlood(t *testing.T) {
	if testing.Short() {
		t.Skip("runs an agent process")
	}
	const limit, flood = 200, 400
	lowerLimit := func(cmd *exec.Cmd) {
		// The shell sets the soft and the hard limit, so the Go
		// runtime cannot raise it again.
		cmd.Args = append([]string{"sh", "-c", `ulimit -n ` + strconv.Itoa(limit) + ` && exec "$0" "$@"`, cmd.Path}, cmd.Args[1:]...)
		cmd.Path = "/bin/sh"
	}
	a := startWrappedAgent(t, filepath.Join(t.TempDir(), "state"), lowerLimit)
	a.waitFor("/healthz", http.StatusOK, 60*time.Second)
	sock := filepath.Join(a.dir, shell.SocketName)

	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for range flood {
		c, err := net.DialTimeout("unix", sock, time.Second)
		if err != nil {
			continue // the listen backlog is full
		}
		conns = append(conns, c)
	}
	t.Logf("%d of %d connections made", len(conns), flood)
	// The connections past the agent's cap are answered with an error.
	refused := 0
	for _, c := range conns {
		c.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
		buf := make([]byte, 512)
		if n, _ := c.Read(buf); n > 0 && strings.Contains(string(buf[:n]), "too many shell connections") {
			refused++
		}
	}
	if refused == 0 {
		t.Errorf("none of %d connections was refused with an error", len(conns))
	}
	if code, body := a.probe("/healthz"); code != http.StatusOK {
		t.Errorf("/healthz %d during the flood:\n%s", code, body)
	}
	for _, c := range conns {
		c.Close()
	}
	conns = nil

	// The agent notices the closed connections as it gets to them: a
	// client may be refused, with the reason, until it did, as a script
	// that retries would be.
	start := time.Now()
	for {
		sh := a.dial()
		out, err := sh.Run(time.Now().Add(5*time.Second), "identity/list")
		sh.Close()
		if err == nil {
			break
		}
		if !strings.Contains(err.Error(), "too many shell connections") || time.Since(start) > time.Second {
			t.Fatalf("shell command %s after the flood: %v %s", time.Since(start).Round(time.Millisecond), err, out)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if took := time.Since(start); took > time.Second {
		t.Errorf("the shell command after the flood took %s", took)
	}
	if code, body := a.probe("/healthz"); code != http.StatusOK {
		t.Errorf("/healthz %d after the flood:\n%s", code, body)
	}
	t.Logf("%d connections refused with an error", refused)
}
