package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/identityd/identityd/cells/allocator"
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
	if testing.Short() {
		t.Skip("starts an agent process")
	}
	// Both the agent and the client hold this variable; "$IDENTITYD_SECRET"
	// in an argument must stay those 17 bytes.
	t.Setenv("IDENTITYD_SECRET", "leaked-secret")
	dir := t.TempDir()
	var logs bytes.Buffer
	agent := agentCmd(t, "--state-dir", dir, "--ipcache-map", "file", "--prometheus-serve-addr", "127.0.0.1:0")
	agent.Stdout, agent.Stderr = &logs, &logs
	if err := agent.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { agent.Process.Kill(); agent.Wait() })
	shell := func(args ...string) (string, error) {
		return run(t, append([]string{"shell", "--state-dir", dir, "--"}, args...)...)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		out, err := shell("identity/list")
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent did not answer: %v\n%s\nlogs:\n%s", err, out, logs.String())
		}
		time.Sleep(200 * time.Millisecond)
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
			out, err := shell(append([]string{"identity/allocate"}, args...)...)
			if err == nil || !strings.Contains(out, "k8s:app=flag-like") {
				t.Errorf("identity/allocate %q: %v %q, want an error naming the format", args, err, out)
			}
			continue
		}
		if err != nil {
			t.Fatalf("test case %q is not a label set: %v", args, err)
		}
		out, err := shell(append([]string{"identity/allocate", "-o", "json"}, args...)...)
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
		out, err := shell(append([]string{"identity/allocate"}, tc.args...)...)
		if err == nil || !strings.Contains(out, tc.want) {
			t.Errorf("identity/allocate %q: %v %q, want an error saying %q", tc.args, err, out, tc.want)
		}
	}

	// Exactly the label sets above were allocated, each once.
	out, err := shell("identity/list", "-o", "json")
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
