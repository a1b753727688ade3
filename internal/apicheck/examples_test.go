package apicheck

import (
	"bytes"
	"encoding/json"
	"errors"
	"go/doc"
	"go/parser"
	"go/token"
	"io"
	"os/exec"
	"path/filepath"
	"testing"
)

// TestPublicPackagesHaveExamples: every public package (cells/..., labels,
// identity, testenv) has at least one Example with an output comment, so
// that go doc shows how the package is used and go test runs it. A command
// (testenv/prebuild) is run, not imported: its doc shows how.
func TestPublicPackagesHaveExamples(t *testing.T) {
	cmd := exec.CommandContext(t.Context(), "go", append([]string{"list", "-json=ImportPath,Name,Dir,TestGoFiles,XTestGoFiles"}, publicPatterns...)...)
	cmd.Dir = "../.."
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	checked := 0
	for dec := json.NewDecoder(bytes.NewReader(out)); ; {
		var p struct {
			ImportPath, Name, Dir     string
			TestGoFiles, XTestGoFiles []string
		}
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		if p.Name == "main" {
			continue
		}
		checked++
		if n := runnableExamples(t, p.Dir, append(p.TestGoFiles, p.XTestGoFiles...)); n == 0 {
			t.Errorf("%s has no Example function with an // Output: comment", p.ImportPath)
		}
	}
	if checked < 10 {
		t.Fatalf("only %d public packages listed", checked)
	}
}

// runnableExamples counts the examples of the test files that go test
// runs: those with an output comment.
func runnableExamples(t *testing.T, dir string, files []string) int {
	t.Helper()
	fset := token.NewFileSet()
	n := 0
	for _, name := range files {
		f, err := parser.ParseFile(fset, filepath.Join(dir, name), nil, parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		for _, ex := range doc.Examples(f) {
			if ex.Output != "" || ex.EmptyOutput {
				n++
			}
		}
	}
	return n
}
