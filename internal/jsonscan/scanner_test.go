package jsonscan

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"unicode/utf8"
)

// valid reports whether data is one JSON value with optional whitespace
// around it, as the scanner reads it.
func valid(data []byte) (bool, error) {
	s := New(data)
	s.SkipSpace()
	if err := s.SkipValue(0); err != nil {
		return false, err
	}
	s.SkipSpace()
	if !s.AtEnd() {
		return false, s.Fail("data after the value")
	}
	return true, nil
}

var syntaxInputs = []string{
	``, ` `, `null`, `true`, `false`, `nul`, `truex`, `0`, `-0`, `01`, `-`, `1.`, `1.5`, `1e`, `1e+`, `1E-7`,
	`-12.5e+30`, `""`, `"a\"b"`, `"\u00e9\ud834\udd1e"`, `"\ud800"`, `"\u12"`, `"\q"`, "\"a\nb\"", `"abc`,
	`[]`, `[1,]`, `[,1]`, `[1 2]`, `[1,[2,[3]]]`, `{}`, `{"a":1}`, `{"a":1,}`, `{"a" 1}`, `{a:1}`, `{"a":}`,
	`{"a":[{"b":null}],"c":"d"}`, `  [ 1 , { "a" : [ ] } ]  `, `[] []`, "\x00", "\"\xff\xfe\"",
	strings.Repeat("[", MaxDepth) + strings.Repeat("]", MaxDepth),
}

// TestSkipValueAgreesWithEncodingJSON checks the syntax checks against the
// standard library's, within the nesting bound.
func TestSkipValueAgreesWithEncodingJSON(t *testing.T) {
	for _, in := range syntaxInputs {
		got, err := valid([]byte(in))
		if want := json.Valid([]byte(in)); got != want {
			t.Errorf("%.40q: valid %v (%v), encoding/json says %v", in, got, err, want)
		}
		if err != nil && !errors.As(err, new(*SyntaxError)) {
			t.Errorf("%.40q: %T is not a *SyntaxError", in, err)
		}
	}
}

func TestSkipValueDepth(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want string
	}{
		// The top-level value is at depth 0: MaxDepth+1 levels are fine.
		{strings.Repeat("[", MaxDepth+1) + strings.Repeat("]", MaxDepth+1), ""},
		{strings.Repeat("[", MaxDepth+2) + strings.Repeat("]", MaxDepth+2), "nesting too deep at offset 513"},
		{strings.Repeat(`{"a":`, MaxDepth+2) + "1" + strings.Repeat("}", MaxDepth+2), "nesting too deep at offset 2565"},
		{strings.Repeat("[", 100000), "nesting too deep at offset 513"},
	} {
		_, err := valid([]byte(tc.in))
		if (err == nil) != (tc.want == "") || (err != nil && err.Error() != tc.want) {
			t.Errorf("%.20q...: got %v, want %q", tc.in, err, tc.want)
		}
	}
}

func TestSyntaxErrorOffsets(t *testing.T) {
	for _, tc := range []struct {
		in, want string
	}{
		{``, "unexpected end of input at offset 0"},
		{`[1,`, "unexpected end of input at offset 3"},
		{`{"a":1 "b":2}`, "expected ',' or '}' in object at offset 7"},
		{`{"a" 1}`, "expected ':' after object key at offset 5"},
		{`{1:2}`, "expected object key at offset 1"},
		{`[1 2]`, "expected ',' or ']' in array at offset 3"},
		{`1.x`, "invalid number at offset 2"},
		{`"ab`, "unterminated string at offset 3"},
		{`"a\`, "unterminated string at offset 3"},
		{`"a\x"`, "invalid escape at offset 3"},
		{`"\u12x4"`, "invalid \\u escape at offset 2"},
		{"\"a\tb\"", "control character in string at offset 2"},
		{`nulL`, "invalid character at offset 0"},
		{`1 2`, "data after the value at offset 2"},
	} {
		_, err := valid([]byte(tc.in))
		if err == nil || err.Error() != tc.want {
			t.Errorf("%q: got %v, want %s", tc.in, err, tc.want)
		}
	}
}

func TestReadString(t *testing.T) {
	for _, tc := range []struct {
		in, want string
	}{
		{`""`, ""},
		{`"plain"`, "plain"},
		{`"a\"b\\c\/d\b\f\n\r\t"`, "a\"b\\c/d\b\f\n\r\t"},
		{`"\u00e9\u20ac\ud834\udd1e"`, "é€𝄞"},
		{`"\ud834x"`, "\uFFFDx"},
		{`"\ud834\u0041"`, "\uFFFDA"},
		{`"\udd1e\ud834"`, "\uFFFD\uFFFD"},
		{"\"\xff\"", "\xff"},
	} {
		s := New([]byte(tc.in))
		got, err := s.ReadString()
		if err != nil || string(got) != tc.want || !s.AtEnd() {
			t.Errorf("%s: got %q, %v, at %d", tc.in, got, err, s.Offset())
		}
	}
}

func TestReadStringReusesBuffer(t *testing.T) {
	s := New([]byte(`"\n" "\t"`))
	a, _ := s.ReadString()
	first := &a[0]
	s.SkipSpace()
	b, _ := s.ReadString()
	if string(b) != "\t" || &b[0] != first {
		t.Fatalf("second escaped string %q does not reuse the buffer", b)
	}
	plain := []byte(`"no escapes here"`)
	if allocs := testing.AllocsPerRun(100, func() {
		s := New(plain)
		s.ReadString()
	}); allocs != 0 {
		t.Fatalf("a string without escapes allocates %v times", allocs)
	}
}

func TestReadNumber(t *testing.T) {
	s := New([]byte(`-12.5e+3,`))
	got, err := s.ReadNumber()
	if err != nil || string(got) != "-12.5e+3" || s.Peek() != ',' {
		t.Fatalf("%q %v, next %q", got, err, s.Peek())
	}
}

func TestEachField(t *testing.T) {
	s := New([]byte(`{ "a" : 1 , "B\u0043" : [true] , "d":{"e":"f"} }`))
	if s.Peek() != '{' {
		t.Fatal("not an object")
	}
	s.Advance()
	var names []string
	err := s.EachField(func(name []byte) error {
		names = append(names, string(name))
		return s.SkipValue(1)
	})
	if err != nil || strings.Join(names, ",") != "a,BC,d" || !s.AtEnd() {
		t.Fatalf("%v %v at %d", names, err, s.Offset())
	}
	stop := errors.New("stop")
	s = New([]byte(`{"a":1}`))
	s.Advance()
	if err := s.EachField(func([]byte) error { return stop }); err != stop {
		t.Fatalf("the callback's error is not returned: %v", err)
	}
}

func TestEqualFold(t *testing.T) {
	for _, tc := range []struct {
		b, lower string
		want     bool
	}{
		{"id", "id", true}, {"ID", "id", true}, {"Id", "id", true}, {"idx", "id", false},
		{"i", "id", false}, {"labels", "labels", true}, {"LABELS", "labels", true}, {"label5", "labels", false},
		{"ı" + "d", "id", false}, {"", "", true},
	} {
		if got := EqualFold([]byte(tc.b), tc.lower); got != tc.want {
			t.Errorf("EqualFold(%q, %q) = %v", tc.b, tc.lower, got)
		}
	}
}

func TestLiteral(t *testing.T) {
	s := New([]byte("nul"))
	if s.Literal("null") || s.Offset() != 0 {
		t.Fatal("a partial literal was read")
	}
	s = New([]byte("null,"))
	if !s.Literal("null") || s.Peek() != ',' {
		t.Fatal("literal not read")
	}
}

// FuzzSkipValue checks that the scanner never panics and agrees with
// encoding/json on what is valid JSON (within the nesting bound), and that
// every string it reads unescapes as encoding/json's does.
func FuzzSkipValue(f *testing.F) {
	for _, in := range syntaxInputs {
		f.Add([]byte(in))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		got, err := valid(data)
		if err != nil {
			var serr *SyntaxError
			if !errors.As(err, &serr) || serr.Offset < 0 || serr.Offset > len(data) {
				t.Fatalf("error %v", err)
			}
		}
		if bytes.Count(data, []byte("["))+bytes.Count(data, []byte("{")) <= MaxDepth {
			if want := json.Valid(data); got != want {
				t.Fatalf("valid %v (%v), encoding/json says %v", got, err, want)
			}
		}
		if len(data) > 0 && data[0] == '"' {
			s := New(data)
			str, err := s.ReadString()
			if err != nil || !utf8.Valid(str) {
				return
			}
			var want string
			if err := json.Unmarshal(data[:s.Offset()], &want); err != nil || want != string(str) {
				t.Fatalf("read %q, encoding/json reads %q (%v)", str, want, err)
			}
		}
	})
}
