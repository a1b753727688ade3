package logtext

import (
	"errors"
	"strings"
	"testing"
	"unicode/utf8"
)

func TestCap(t *testing.T) {
	if got := Cap("short"); got != "short" {
		t.Errorf("Cap(short) = %q", got)
	}
	exact := strings.Repeat("a", Max)
	if got := Cap(exact); got != exact {
		t.Errorf("a value of Max bytes was changed: %q", got)
	}
	long := strings.Repeat("x", 200_000)
	got := Cap(long)
	if len(got) > Max+64 || !strings.HasPrefix(got, strings.Repeat("x", Max)) || !strings.Contains(got, "200000 bytes in all") {
		t.Errorf("Cap of 200,000 bytes = %d bytes: %.400q", len(got), got)
	}
	// A multi-byte character across the cut is not split.
	multi := strings.Repeat("a", Max-1) + "é" + strings.Repeat("b", 10)
	if got := Cap(multi); !utf8.ValidString(got) || strings.Contains(got, "é") {
		t.Errorf("Cap split a character or kept it past the cut: %q", got)
	}
}

func TestError(t *testing.T) {
	if Error(nil) != nil {
		t.Error("Error(nil) is not nil")
	}
	base := errors.New(strings.Repeat("y", 10_000))
	err := Error(base)
	if len(err.Error()) > Max+64 {
		t.Errorf("capped error text is %d bytes", len(err.Error()))
	}
	if !errors.Is(err, base) {
		t.Error("the capped error does not unwrap to its cause")
	}
}
