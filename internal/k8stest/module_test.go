package k8stest

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/identityd/identityd/internal/testproc"
)

// TestServerModuleShipsInTheModule: the API server's module has no go.mod
// in this module's tree, which would make it a nested module that the go
// command leaves out of identityd's module zip, so that a test of a module
// importing testenv could not build the server from the module cache; it
// is written out whole as a module of its own for the build.
func TestServerModuleShipsInTheModule(t *testing.T) {
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	root := filepath.Join(wd, "..", "..")
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatalf("the module root is not two levels up: %v", err)
	}
	for dir := filepath.Join(root, ServerModule); dir != root; dir = filepath.Dir(dir) {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			t.Errorf("%s has a go.mod: the module zip would leave it out", dir)
		}
	}
	dir, err := testproc.ModuleSource(ServerModule)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"go.mod", "go.sum", "main.go"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Errorf("the written-out module lacks %s: %v", f, err)
		}
	}
	gomod, err := os.ReadFile(filepath.Join(dir, "go.mod"))
	if err != nil || !strings.Contains(string(gomod), "k8s.io/kubernetes ") {
		t.Errorf("the written-out go.mod does not require k8s.io/kubernetes (%v)", err)
	}
}
