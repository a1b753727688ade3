package shell_test

import (
	"errors"
	"slices"
	"testing"

	"github.com/identityd/identityd/cells/shell"
)

func TestSplit(t *testing.T) {
	for _, tc := range []struct {
		line string
		want []string
	}{
		{"", nil},
		{" \t ", nil},
		{"identity/list", []string{"identity/list"}},
		{"  identity/allocate\tk8s:a=b   k8s:c=d ", []string{"identity/allocate", "k8s:a=b", "k8s:c=d"}},
		{"a 'k8s:app=a b'", []string{"a", "k8s:app=a b"}},
		{`a "k8s:app=a b"`, []string{"a", "k8s:app=a b"}},
		{`a k8s:app=a\ b`, []string{"a", "k8s:app=a b"}},
		{`a 'it'\''s'`, []string{"a", "it's"}},
		{"a \"say \\\"hi\\\" \\\\ \\n \\$x \\`id\\`\"", []string{"a", `say "hi" \ \n $x ` + "`id`"}},
		{`a '\n \"' \\ \x`, []string{"a", `\n \"`, `\`, "x"}},
		{`a $HOME ${PATH} $(id) ` + "`id`", []string{"a", "$HOME", "${PATH}", "$(id)", "`id`"}},
		{"a # not a comment", []string{"a", "#", "not", "a", "comment"}},
		{"a;b & c|d >e <f ~ * ?", []string{"a;b", "&", "c|d", ">e", "<f", "~", "*", "?"}},
		{`a '' "" x''y`, []string{"a", "", "", "xy"}},
		{`a 'b'"c"d\ e`, []string{"a", "bcd e"}},
		{"a żółw\\ 🐢 '\t'", []string{"a", "żółw 🐢", "\t"}},
	} {
		got, err := shell.Split(tc.line)
		if err != nil || !slices.Equal(got, tc.want) {
			t.Errorf("Split(%q) = %q, %v; want %q", tc.line, got, err, tc.want)
		}
	}
	for _, tc := range []struct {
		line string
		want error
	}{
		{"a 'b", shell.ErrUnterminatedQuote},
		{`a "b`, shell.ErrUnterminatedQuote},
		{`a "b\"`, shell.ErrUnterminatedQuote},
		{`a b\`, shell.ErrTrailingBackslash},
	} {
		if got, err := shell.Split(tc.line); !errors.Is(err, tc.want) {
			t.Errorf("Split(%q) = %q, %v; want %v", tc.line, got, err, tc.want)
		}
	}
}
