package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/shell"
	"github.com/identityd/identityd/labels"
)

// TestShellArgumentsVerbatim runs the agent as a process and allocates
// through `identityd shell -- identity/allocate ARGS` with hostile
// arguments: each argument must become exactly one label, whatever it
// holds (spaces, '$', '#', quotes, unicode, 5,000 bytes, a line longer
// than any buffer), nothing from an environment may be substituted, and
// an argument that is not a valid label is refused with a clear error
// instead of being rewritten or starting a second command.
func TestShellArgumentsVerbatim(t *testing.T) {
	parallelProcess(t)
	if testing.Short() {
		t.Skip("starts an agent process")
	}
	// Both the agent and the client hold this variable; "$IDENTITYD_SECRET"
	// in an argument must stay those 17 bytes.
	secret := "IDENTITYD_SECRET=leaked-secret"
	dir := startAgentProc(t, secret)
	sh := func(args ...string) (string, error) {
		return runEnv(t, []string{secret}, append([]string{"shell", "--state-dir", dir, "--"}, args...)...)
	}

	// The old line protocol read 4,096 bytes at a time and ran the rest of
	// a longer line as a command of its own: this argument vector put
	// "identity/allocate k8s:injected=yes" right after that boundary.
	const prefix = "identity/allocate -o json k8s:pad="
	pad := strings.Repeat("x", 4096-len(prefix)-1)
	long := strings.Repeat("v", 5000)
	ok := [][]string{
		{"k8s:app=a b"},
		{"k8s:app=$IDENTITYD_SECRET", "k8s:home=${IDENTITYD_SECRET}x", "k8s:dollar=$"},
		{"k8s:app=a#b", "k8s:comment=# not a comment"},
		{`k8s:app=it's "quoted" ''`, `k8s:back=\n\t\\`, "k8s:semi=a b & c | d > e"},
		{"k8s:app=żółw 🐢 ünïcödé"},
		{"k8s:app=" + long},
		{"k8s:pad=" + pad, "identity/allocate", "k8s:injected=yes"},
		{"-o", "k8s:app=flag-like", "k8s:app=web"},
	}
	for _, args := range ok {
		lbls, err := labels.Parse(args...)
		if args[0] == "-o" {
			// "-o" is the output flag of identity/allocate, with the next
			// argument as its value: a bad format, refused before any
			// allocation.
			out, err := sh(append([]string{"identity/allocate"}, args...)...)
			if err == nil || !strings.Contains(out, "k8s:app=flag-like") {
				t.Errorf("identity/allocate %q: %v %q, want an error naming the format", args, err, out)
			}
			continue
		}
		if err != nil {
			t.Fatalf("test case %q is not a label set: %v", args, err)
		}
		out, err := sh(append([]string{"identity/allocate", "-o", "json"}, args...)...)
		if err != nil {
			t.Errorf("identity/allocate %.100q: %v\n%.500s", args, err, out)
			continue
		}
		var entries []allocator.Entry
		if i := strings.Index(out, "[\n"); i < 0 || json.Unmarshal([]byte(out[i:]), &entries) != nil || len(entries) != 1 {
			t.Errorf("identity/allocate %.100q: output %.500q", args, out)
			continue
		}
		if got := entries[0].Identity.Labels; !got.Equal(lbls) {
			t.Errorf("identity/allocate %.100q: labels %.300q, want %.300q", args, got.Strings(), lbls.Strings())
		}
	}

	// A control character is not allowed in a label: a clear error, and no
	// second command from a newline.
	bad := []struct {
		args []string
		want string
	}{
		{[]string{"k8s:app=a\tb"}, "control character"},
		{[]string{"k8s:app=x\nidentity/allocate k8s:newline=yes"}, "control character"},
		{[]string{"k8s:app=x\ridentity/allocate k8s:return=yes"}, "control character"},
	}
	for _, tc := range bad {
		out, err := sh(append([]string{"identity/allocate"}, tc.args...)...)
		if err == nil || !strings.Contains(out, tc.want) {
			t.Errorf("identity/allocate %q: %v %q, want an error saying %q", tc.args, err, out, tc.want)
		}
	}

	// Lines read from a pipe are split like POSIX shell words, with
	// nothing expanded; a line over the request limit, or with an open
	// quote, is refused whole, and nothing after "exit" runs.
	script := strings.Join([]string{
		`identity/allocate -o json 'k8s:piped=a b' "k8s:quoted=\"x\" \$HOME" k8s:dollar=$IDENTITYD_SECRET k8s:hash=#x`,
		"identity/allocate k8s:crlf=yes\r",
		"identity/allocate k8s:big=" + strings.Repeat("b", shell.MaxRequestBytes),
		`identity/allocate 'k8s:open=quote`,
		"exit",
		"identity/allocate k8s:after=exit",
	}, "\n")
	piped := []string{`k8s:piped=a b`, `k8s:quoted="x" $HOME`, "k8s:dollar=$IDENTITYD_SECRET", "k8s:hash=#x"}
	out, err := runStdin(t, script, []string{secret}, "shell", "--state-dir", dir)
	if err == nil || !strings.Contains(out, "2 of 4 commands failed") || !strings.Contains(out, "at most 1048576 allowed") ||
		!strings.Contains(out, "unterminated quote") || !strings.Contains(out, `"value": "a b"`) {
		t.Errorf("piped commands: %v\n%.2000s", err, out)
	}
	ok = append(ok, piped, []string{"k8s:crlf=yes"})

	// Exactly the label sets above were allocated, each once.
	out, err = sh("identity/list", "-o", "json")
	if err != nil {
		t.Fatalf("identity/list: %v\n%.500s", err, out)
	}
	var entries []allocator.Entry
	if i := strings.Index(out, "[\n"); i < 0 || json.Unmarshal([]byte(out[i:]), &entries) != nil {
		t.Fatalf("identity/list output %.500q", out)
	}
	var got []string
	for _, e := range entries {
		if e.Source == allocator.SourceReserved {
			continue
		}
		got = append(got, e.Identity.Labels.String())
		if e.RefCount != 1 {
			t.Errorf("identity %s %.200s: %d references, want 1", e.Identity.ID, e.Identity.Labels, e.RefCount)
		}
	}
	var want []string
	for _, args := range ok {
		if args[0] != "-o" {
			want = append(want, labels.MustParse(args...).String())
		}
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("allocated label sets:\n%s\nwant:\n%s", short(got), short(want))
	}
}

// short shows label sets with long values cut, for error messages.
func short(sets []string) string {
	var b strings.Builder
	for _, s := range sets {
		if len(s) > 120 {
			s = fmt.Sprintf("%s...(%d bytes)", s[:120], len(s))
		}
		fmt.Fprintf(&b, "  %q\n", s)
	}
	return b.String()
}

// runEnv is run with env added to identityd's environment.
func runEnv(t *testing.T, env []string, args ...string) (string, error) {
	var out bytes.Buffer
	cmd := agentCmd(t, args...)
	cmd.Env = append(cmd.Env, env...)
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), err
}

// runStdin runs identityd with args, stdin as its standard input and env
// added to its environment.
func runStdin(t *testing.T, stdin string, env []string, args ...string) (string, error) {
	var out bytes.Buffer
	cmd := agentCmd(t, args...)
	cmd.Env = append(cmd.Env, env...)
	cmd.Stdin = strings.NewReader(stdin)
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), err
}

// startAgentProc runs the agent as a process on a fresh state directory,
// with env added to its environment, and returns the directory once the
// agent's shell answers.
func startAgentProc(t *testing.T, env ...string) string {
	t.Helper()
	dir := t.TempDir()
	var logs syncBuffer
	agent := agentCmd(t, "--state-dir", dir, "--ipcache-map", "file", "--prometheus-serve-addr", "127.0.0.1:0")
	agent.Env = append(agent.Env, env...)
	agent.Stdout, agent.Stderr = &logs, &logs
	if err := agent.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { agent.Process.Kill(); agent.Wait() })
	deadline := time.Now().Add(60 * time.Second)
	for {
		out, err := run(t, "shell", "--state-dir", dir, "--", "identity/list")
		if err == nil {
			return dir
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent did not answer: %v\n%s\nlogs:\n%s", err, out, logs.String())
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// syncBuffer is a bytes.Buffer that a process and a test can share.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// TestShellTerminal runs the interactive shell on a pseudo-terminal: a
// typed line is split into words with its quotes, and Ctrl-C interrupts a
// command that runs until stopped (db/watch) and returns to the prompt,
// where the next command works.
func TestShellTerminal(t *testing.T) {
	parallelProcess(t)
	if testing.Short() {
		t.Skip("starts an agent process")
	}
	dir := startAgentProc(t)
	master, slave, err := openPTY()
	if err != nil {
		t.Skipf("no pseudo-terminal: %v", err)
	}
	defer master.Close()
	cmd := agentCmd(t, "shell", "--state-dir", dir)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = slave, slave, slave
	// Its own session with the terminal as the controlling one, so that
	// Ctrl-C on the terminal is a SIGINT to it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	slave.Close()
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	var screen syncBuffer
	go io.Copy(&screen, master)
	waitFor := func(what string, n int) {
		t.Helper()
		deadline := time.Now().Add(60 * time.Second)
		for strings.Count(screen.String(), what) < n {
			if time.Now().After(deadline) {
				t.Fatalf("no %q on the terminal:\n%s", what, screen.String())
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	typeLine := func(line string) {
		t.Helper()
		if _, err := master.Write([]byte(line)); err != nil {
			t.Fatal(err)
		}
	}
	waitFor("identityd> ", 1)
	typeLine("identity/allocate 'k8s:tty=a b' \"k8s:d=$HOME\"\r")
	waitFor("k8s:d=$HOME,k8s:tty=a b ", 1)
	waitFor("identityd> ", 2)
	typeLine("db/watch identities\r")
	waitFor("reserved:host", 1)
	typeLine("\x03")
	waitFor("interrupted", 1)
	waitFor("identityd> ", 3)
	typeLine("identity/get 'k8s:tty=a b' k8s:d=\\$HOME\r")
	waitFor("k8s:d=$HOME,k8s:tty=a b ", 2)
	typeLine("exit\r")
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("shell exited with %v:\n%s", err, screen.String())
		}
	case <-time.After(60 * time.Second):
		t.Fatalf("shell did not exit:\n%s", screen.String())
	}
}

// openPTY opens a pseudo-terminal pair.
func openPTY() (master, slave *os.File, err error) {
	fd, err := unix.Open("/dev/ptmx", unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, nil, err
	}
	master = os.NewFile(uintptr(fd), "/dev/ptmx")
	if err := unix.IoctlSetPointerInt(fd, unix.TIOCSPTLCK, 0); err != nil {
		master.Close()
		return nil, nil, err
	}
	n, err := unix.IoctlGetInt(fd, unix.TIOCGPTN)
	if err != nil {
		master.Close()
		return nil, nil, err
	}
	slave, err = os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		master.Close()
		return nil, nil, err
	}
	return master, slave, nil
}
