package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// TestShellOutputOnlyTheDocument runs the agent as a process and the shell
// commands that also print a note for the reader of a table (a new
// identity, an empty map, a missing checkpoint) with -o json and -o yaml:
// what `identityd shell` writes on stdout must be the one document and
// nothing else, so that `identityd shell -- identity/allocate -o json … |
// jq` reads it. The table keeps its note.
func TestShellOutputOnlyTheDocument(t *testing.T) {
	parallelProcess(t)
	dir := startAgentProc(t)
	shell := func(args ...string) string {
		t.Helper()
		var stdout, stderr bytes.Buffer
		cmd := agentCmd(t, append([]string{"shell", "--state-dir", dir, "--"}, args...)...)
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Run(); err != nil {
			t.Fatalf("identityd shell -- %s: %v\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), err, stdout.String(), stderr.String())
		}
		return stdout.String()
	}

	// decodeJSON decodes out as a JSON decoder on a pipe does: one value,
	// then the end of the input.
	decodeJSON := func(args []string, out string) []map[string]any {
		t.Helper()
		dec := json.NewDecoder(strings.NewReader(out))
		var v []map[string]any
		if err := dec.Decode(&v); err != nil {
			t.Fatalf("identityd shell -- %s: stdout is not a JSON document: %v\n%s", strings.Join(args, " "), err, out)
		}
		var more json.RawMessage
		if err := dec.Decode(&more); !errors.Is(err, io.EOF) {
			t.Fatalf("identityd shell -- %s: stdout holds more than the JSON document (%v)\n%s", strings.Join(args, " "), err, out)
		}
		return v
	}
	decodeYAML := func(args []string, out string) []map[string]any {
		t.Helper()
		var v []map[string]any
		if err := yaml.UnmarshalStrict([]byte(out), &v); err != nil {
			t.Fatalf("identityd shell -- %s: stdout is not one YAML document: %v\n%s", strings.Join(args, " "), err, out)
		}
		return v
	}

	for _, format := range []string{"json", "yaml"} {
		decode := decodeJSON
		if format == "yaml" {
			decode = decodeYAML
		}
		// A label set of its own per format, so that each allocation is new.
		prefix := map[string]string{"json": "10.1.0.0/16", "yaml": "10.2.0.0/16"}[format]
		args := []string{"identity/allocate", "-o", format, "cidr:" + prefix, "reserved:world"}
		got := decode(args, shell(args...))
		if len(got) != 1 {
			t.Fatalf("%s: %d entries, want the one allocated: %v", strings.Join(args, " "), len(got), got)
		}
		id, _ := got[0]["identity"].(map[string]any)
		lbls, _ := id["labels"].([]any)
		if id["id"] == nil || !slices.ContainsFunc(lbls, func(l any) bool {
			m, _ := l.(map[string]any)
			return m["source"] == "cidr" && m["key"] == prefix
		}) {
			t.Errorf("%s: entry %v, want the identity of %s", strings.Join(args, " "), got[0], prefix)
		}

		args = []string{"ipcache/map-dump", "-o", format}
		if got := decode(args, shell(args...)); len(got) != 0 {
			t.Errorf("%s: %v, want the empty map", strings.Join(args, " "), got)
		}
		args = []string{"checkpoint/show", "-o", format, "no-such-checkpoint.json"}
		if got := decode(args, shell(args...)); len(got) != 0 {
			t.Errorf("%s: %v, want an empty list", strings.Join(args, " "), got)
		}
	}

	// The table keeps the notes for its reader.
	if out := shell("identity/allocate", "cidr:10.3.0.0/16", "reserved:world"); !strings.Contains(out, "allocated new identity ") {
		t.Errorf("identity/allocate in a table: no note of the new identity:\n%s", out)
	}
	if out := shell("ipcache/map-dump"); !strings.Contains(out, "is empty") {
		t.Errorf("ipcache/map-dump in a table: no note of the empty map:\n%s", out)
	}
}
