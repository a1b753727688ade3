package main

import (
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// mountTmpfs mounts a tmpfs of size bytes on a new directory and returns
// it; it skips the test where mounting is not allowed.
func mountTmpfs(t *testing.T, size string) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("mounting a tmpfs needs root")
	}
	dir := t.TempDir()
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size="+size+",mode=0700", "tmpfs", dir).CombinedOutput(); err != nil {
		t.Skipf("cannot mount a tmpfs: %v %s", err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command("umount", "-l", dir).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v %s", dir, err, out)
		}
	})
	return dir
}

// fill writes a file in dir until its file system is full.
func fill(t *testing.T, dir string) string {
	t.Helper()
	path := filepath.Join(dir, "filler")
	f, err := os.Create(path)
	if err != nil && !errors.Is(err, syscall.ENOSPC) {
		t.Fatal(err)
	}
	if f != nil {
		defer f.Close()
		buf := make([]byte, 1<<20)
		for {
			if _, err := f.Write(buf); err != nil {
				if !errors.Is(err, syscall.ENOSPC) {
					t.Fatal(err)
				}
				break
			}
		}
	}
	// Small files fill the blocks a large one left.
	for i := 0; ; i++ {
		if err := os.WriteFile(path+"-"+strings.Repeat("x", i%50)+string(rune('a'+i%26)), make([]byte, 4096), 0o600); err != nil || i > 10000 {
			break
		}
	}
	return path
}

// TestFullStateFilesystem runs the agent on a 300 MiB tmpfs and fills it:
// answers that need more of the disk fail as not durable (those whose
// journal records still fit in the journals' last pages succeed), /readyz turns 503 naming
// the cause while /healthz stays 200 (a restart would not free space), and
// once space is freed the agent is ready again within seconds, without a
// restart. A start on the full file system then stops with an error that
// says how much space the embedded etcd needs.
func TestFullStateFilesystem(t *testing.T) {
	if testing.Short() {
		t.Skip("runs an agent process")
	}
	mnt := mountTmpfs(t, "300m")
	dir := filepath.Join(mnt, "state")
	a := startHealthAgentIn(t, dir)
	a.waitFor("/readyz", http.StatusOK, 60*time.Second)
	sh := a.dial()
	defer sh.Close()
	if out, err := sh.Run(time.Now().Add(30*time.Second), "ipcache/upsert", "--owner=t", "10.8.0.0/16"); err != nil {
		t.Fatalf("upsert before the disk is full: %v %s", err, out)
	}

	filler := fill(t, mnt)
	// A durable answer appends a few dozen bytes to the journals, which
	// fit in the space their last pages have left: the answers that
	// still fit are durable, and the first that does not fails.
	var (
		out string
		err error
		ok  int
	)
	for i := range 1000 {
		out, err = sh.Run(time.Now().Add(30*time.Second), "ipcache/upsert", "--owner=t", fmt.Sprintf("10.9.%d.%d/32", i>>8, i&0xff))
		if err != nil {
			break
		}
		ok++
	}
	t.Logf("%d upserts answered durably on the full disk before the first failed", ok)
	if err == nil || !strings.Contains(err.Error(), "not durable") {
		t.Errorf("upsert on a full disk: %v %s, want an error saying it is not durable", err, out)
	}
	_, body := a.waitFor("/readyz", http.StatusServiceUnavailable, 15*time.Second)
	if !strings.Contains(body, "no space left on device") {
		t.Errorf("/readyz on a full disk does not name the cause:\n%s", body)
	}
	a.staysLive(3*time.Second, "on a full disk")

	matches, _ := filepath.Glob(filler + "*")
	for _, m := range matches {
		os.Remove(m)
	}
	took, _ := a.waitFor("/readyz", http.StatusOK, 15*time.Second)
	t.Logf("ready %s after space was freed", took.Round(100*time.Millisecond))
	if out, err := sh.Run(time.Now().Add(30*time.Second), "ipcache/upsert", "--owner=t", "10.10.0.0/16"); err != nil {
		t.Errorf("upsert after space was freed: %v %s", err, out)
	}
	sh.Close()
	a.stop(syscall.SIGTERM)

	fill(t, mnt)
	out, err = runAgentToExit(t, "--state-dir", dir, "--ipcache-map", "file", "--prometheus-serve-addr", "", "--log-level", "error")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	last := lines[len(lines)-1]
	if err == nil || !strings.HasPrefix(last, "identityd: ") || !strings.Contains(last, "too little free space for the embedded etcd") || !strings.Contains(last, "MiB free") {
		t.Fatalf("start on a full disk: %v, last line %q; output:\n%s", err, last, out)
	}
}

// TestFullMapNotReady fills the datapath map (the file backend with room
// for 2 entries): /readyz turns 503 naming the full map while /healthz
// stays 200 (a restart would not make room), and the agent is ready again
// once the prefixes past the capacity are deleted.
func TestFullMapNotReady(t *testing.T) {
	parallelProcess(t)
	if testing.Short() {
		t.Skip("runs an agent process")
	}
	a := startHealthAgent(t, "--ipcache-map-max-entries", "2")
	a.waitFor("/readyz", http.StatusOK, 60*time.Second)
	sh := a.dial()
	defer sh.Close()
	for _, p := range []string{"10.1.0.0/16", "10.2.0.0/16", "10.3.0.0/16"} {
		// The third one is in the table but not in the map.
		sh.Run(time.Now().Add(30*time.Second), "ipcache/upsert", "--owner=t", "--no-wait", p)
	}
	_, body := a.waitFor("/readyz", http.StatusServiceUnavailable, 15*time.Second)
	if !strings.Contains(body, "ipcache map is full") {
		t.Errorf("/readyz with a full map does not name the cause:\n%s", body)
	}
	a.staysLive(3*time.Second, "with a full map")
	if out, err := sh.Run(time.Now().Add(30*time.Second), "ipcache/delete", "--owner=t", "10.3.0.0/16"); err != nil {
		t.Fatalf("delete: %v %s", err, out)
	}
	a.waitFor("/readyz", http.StatusOK, 15*time.Second)
}

// staysLive probes /healthz every second for d: it must answer 200 (a
// restart would not help with the condition).
func (a *healthAgent) staysLive(d time.Duration, condition string) {
	a.t.Helper()
	for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(time.Second) {
		if code, body := a.probe("/healthz"); code != http.StatusOK {
			a.t.Fatalf("/healthz %d %s (a restart would not help):\n%s", code, condition, body)
		}
	}
}
