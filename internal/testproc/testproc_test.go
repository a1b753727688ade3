package testproc

import (
	"os"
	"path/filepath"
	"testing"
)

func TestSourceKeyFollowsSources(t *testing.T) {
	root := t.TempDir()
	write := func(path, content string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(filepath.Join(root, path)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, path), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	key := func() string {
		t.Helper()
		k, err := sourceKey(root, "cmd/x")
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	write("go.mod", "module m\n")
	write("cmd/x/main.go", "package main\n\nfunc main() {}\n")
	k0 := key()
	if key() != k0 {
		t.Fatal("key of unchanged sources changed")
	}
	for _, change := range [][2]string{
		{"cmd/x/main.go", "package main\n\nfunc main() { println() }\n"},
		{"cmd/x/extra.go", "package main\n"},
		{"go.sum", "example.com/m v1.0.0 h1:x=\n"},
		{"go.mod", "module m\n\ngo 1.26\n"},
	} {
		write(change[0], change[1])
		if k := key(); k == k0 {
			t.Errorf("key unchanged after writing %s", change[0])
		} else {
			k0 = k
		}
	}
	if _, err := sourceKey(root, "cmd/none"); err == nil {
		t.Error("no error for a package without Go files")
	}
}

func TestFreePortsDistinct(t *testing.T) {
	ports, err := FreePorts(20)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int]bool{}
	for _, p := range ports {
		if seen[p] || p <= 0 {
			t.Fatalf("ports %v: %d repeated or invalid", ports, p)
		}
		seen[p] = true
	}
}
