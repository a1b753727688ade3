package k8sclient_test

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/spf13/pflag"

	"github.com/identityd/identityd/cells/k8sclient"
)

// TestOperationsDocFlags: docs/operations.md has a row for every flag of
// the cell, with its default and usage as --help prints them.
func TestOperationsDocFlags(t *testing.T) {
	doc, err := os.ReadFile("../../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	fs := pflag.NewFlagSet("k8sclient", pflag.ContinueOnError)
	k8sclient.DefaultConfig.Flags(fs)
	n := 0
	fs.VisitAll(func(f *pflag.Flag) {
		n++
		def := "`" + f.DefValue + "`"
		if f.DefValue == "" {
			def = "(empty)"
		}
		row := fmt.Sprintf("| `--%s` | %s | %s |\n", f.Name, def, strings.ReplaceAll(f.Usage, "|", "\\|"))
		if !strings.Contains(string(doc), row) {
			t.Errorf("docs/operations.md lacks the row\n%s", row)
		}
	})
	if n != 5 {
		t.Errorf("%d flags; the test expects 5", n)
	}
}
