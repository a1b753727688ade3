package clustermesh

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/identityd/identityd/identity"
)

// TestOperationsDocClusterMeshExample reads the two remote-cluster files
// of docs/operations.md's cluster-mesh example into a directory, as an
// operator would copy them, and checks that the node of the example
// accepts both with what the text says they hold.
func TestOperationsDocClusterMeshExample(t *testing.T) {
	doc, err := os.ReadFile("../../../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	files := regexp.MustCompile("(?s)`/etc/identityd/clustermesh/(c[0-9])`:\\s*```yaml\n(.*?)```").FindAllStringSubmatch(string(doc), -1)
	if len(files) != 2 {
		t.Fatalf("found %d example files in docs/operations.md, want 2", len(files))
	}
	dir := t.TempDir()
	for _, f := range files {
		if err := os.WriteFile(filepath.Join(dir, f[1]), []byte(f[2]), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	// Certificates beside the files are not configurations.
	os.WriteFile(filepath.Join(dir, "c2-ca.crt"), []byte("not yaml"), 0o600)

	got, err := readConfigDir(dir, identity.ClusterInfo{ID: 1, Name: "c1"})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 {
		t.Fatalf("read %d configurations, want c2 and c3", len(got))
	}
	c2, c3 := got["c2"], got["c3"]
	if c2 == nil || c2.err != nil || c3 == nil || c3.err != nil {
		t.Fatalf("c2 %+v, c3 %+v", c2, c3)
	}
	if c2.cfg.ClusterID != 2 || len(c2.cfg.Endpoints) != 2 || c2.cfg.CAFile != filepath.Join(dir, "c2-ca.crt") || c2.cfg.KeyFile == "" {
		t.Errorf("c2: %+v", c2.cfg)
	}
	if c3.cfg.ClusterID != 3 || c3.cfg.CAFile != "/etc/identityd/c3/ca.crt" || !strings.HasSuffix(c3.cfg.PasswordFile, "/c3/password") || c3.cfg.Username != "identityd-c1" {
		t.Errorf("c3: %+v", c3.cfg)
	}
}
