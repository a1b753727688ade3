package main

import (
	"bytes"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// makeRunArgs returns the arguments `make run` gives the agent with the
// state directory dir and extra flags: the command the Makefile's run
// target executes (make -n prints it without running it).
func makeRunArgs(t *testing.T, dir, extra string) []string {
	t.Helper()
	if _, err := exec.LookPath("make"); err != nil {
		t.Skip("make is not on the PATH")
	}
	out, err := exec.Command("make", "-s", "-n", "-C", "../..", "run", "STATE_DIR="+dir, "RUN_FLAGS="+extra).Output()
	if err != nil {
		t.Fatalf("make -n run: %v", err)
	}
	for line := range strings.Lines(string(out)) {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "exec ./bin/identityd "); ok {
			return strings.Fields(rest)
		}
	}
	t.Fatalf("make -n run runs no ./bin/identityd:\n%s", out)
	return nil
}

// TestMakeRunKeepsStateUnderItsDirectory runs two agents as `make run`
// runs them, each with a state directory of its own, as the user the
// test runs as (root included, where --ipcache-map=auto would pin the map
// on the host's bpffs, the same for every state directory): the second
// starts beside the first, its datapath map is its own (it holds none of
// the first agent's prefixes), and both agents open the map file of their
// state directories; RUN_FLAGS=--ipcache-map=bpf still selects the BPF
// map.
func TestMakeRunKeepsStateUnderItsDirectory(t *testing.T) {
	parallelProcess(t)
	type agent struct {
		dir  string
		logs *syncBuffer
	}
	start := func() agent {
		t.Helper()
		a := agent{dir: filepath.Join(t.TempDir(), "state"), logs: &syncBuffer{}}
		cmd := agentCmd(t, makeRunArgs(t, a.dir, "--prometheus-serve-addr=127.0.0.1:0")...)
		cmd.Stdout, cmd.Stderr = a.logs, a.logs
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		exited := make(chan error, 1)
		go func() { exited <- cmd.Wait() }()
		t.Cleanup(func() { cmd.Process.Kill(); <-exited })
		deadline := time.Now().Add(90 * time.Second)
		for {
			if _, err := run(t, "shell", "--state-dir", a.dir, "--", "identity/list"); err == nil {
				return a
			}
			select {
			case err := <-exited:
				exited <- err
				t.Fatalf("an agent of make run with --state-dir %s exited: %v\n%s", a.dir, err, a.logs.String())
			case <-time.After(200 * time.Millisecond):
			}
			if time.Now().After(deadline) {
				t.Fatalf("an agent of make run did not answer:\n%s", a.logs.String())
			}
		}
	}
	shell := func(a agent, args ...string) string {
		t.Helper()
		out, err := run(t, append([]string{"shell", "--state-dir", a.dir, "--"}, args...)...)
		if err != nil {
			t.Fatalf("identityd shell -- %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return out
	}

	// RUN_FLAGS come after the Makefile's flags, so they win.
	root := newRootCmd(newHive(), &bytes.Buffer{}, &bytes.Buffer{})
	if err := root.Flags().Parse(makeRunArgs(t, t.TempDir(), "--ipcache-map=bpf")); err != nil {
		t.Fatal(err)
	}
	if v := root.Flags().Lookup("ipcache-map").Value.String(); v != "bpf" {
		t.Errorf("make run RUN_FLAGS=--ipcache-map=bpf runs the agent with --ipcache-map=%s", v)
	}

	first := start()
	shell(first, "ipcache/upsert", "--owner=make-run", "10.77.0.0/16")
	second := start()
	if out := shell(second, "ipcache/map-dump", "-o", "json"); strings.Contains(out, "10.77.0.0/16") {
		t.Errorf("the second agent's map holds the first agent's prefix: they share a map outside their state directories\n%s", out)
	}
	for _, a := range []agent{first, second} {
		opened := regexp.MustCompile(`IPCache map opened.* kind=(\w+) path=(\S+)`).FindStringSubmatch(a.logs.String())
		if opened == nil {
			t.Errorf("agent of %s: no log line of the map it opened:\n%s", a.dir, a.logs.String())
			continue
		}
		if kind, p := opened[1], opened[2]; kind != "file" || filepath.Dir(p) != a.dir {
			t.Errorf("agent of %s opened a %s map at %s, outside its state directory", a.dir, kind, p)
		}
	}
}
