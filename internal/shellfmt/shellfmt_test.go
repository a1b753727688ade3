package shellfmt

import (
	"strings"
	"testing"
)

type row struct {
	ID    uint32  `json:"id"`
	Big   uint64  `json:"big"`
	Neg   int64   `json:"neg"`
	Ratio float64 `json:"ratio"`
	Name  string  `json:"name"`
}

func (row) TableHeader() []string { return []string{"ID", "Name"} }
func (r row) TableRow() []string  { return []string{"x", r.Name} }

// Large IDs print as integers in YAML, not in exponent form, and strings
// that look like numbers stay strings.
func TestRenderYAMLNumbers(t *testing.T) {
	out, err := Render(YAML, []row{{ID: 16777217, Big: 1 << 63, Neg: -5, Ratio: 0.25, Name: "123"}})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"- big: 9223372036854775808\n",
		"  id: 16777217\n",
		"  name: \"123\"\n",
		"  neg: -5\n",
		"  ratio: 0.25\n",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("missing %q in:\n%s", want, out)
		}
	}
}

func TestRenderTableAndJSON(t *testing.T) {
	out, err := Render(Table, []row{{Name: "a"}})
	if err != nil || out != "ID  Name\nx   a\n" {
		t.Errorf("table: %q, %v", out, err)
	}
	out, err = Render(JSON, []row{{ID: 16777217}})
	if err != nil || !strings.Contains(out, `"id": 16777217`) {
		t.Errorf("json: %q, %v", out, err)
	}
}
