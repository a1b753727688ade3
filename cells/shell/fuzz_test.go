package shell_test

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/identityd/identityd/cells/shell"
)

// encodeArgv and decodeArgv map fuzz input to argument vectors: each
// argument is a uvarint length and that many bytes, so an argument may
// hold any byte at all.
func encodeArgv(args ...string) []byte {
	var b []byte
	for _, a := range args {
		b = binary.AppendUvarint(b, uint64(len(a)))
		b = append(b, a...)
	}
	return b
}

func decodeArgv(b []byte) []string {
	var args []string
	for len(b) > 0 {
		n, k := binary.Uvarint(b)
		if k <= 0 {
			return append(args, string(b))
		}
		b = b[k:]
		n = min(n, uint64(len(b)))
		args = append(args, string(b[:n]))
		b = b[n:]
	}
	return args
}

// FuzzClientServerArgv sends arbitrary argument vectors through the client,
// the socket and the server to a recording command: the command must get
// exactly the vector sent, exactly once, and nothing else may run. A
// vector the protocol cannot carry unchanged (not UTF-8, too large, no
// command) is refused by the client, with nothing sent. When the first
// byte of the input is odd the command's name is fuzzed too; then only a
// name equal to the recorder's may record anything.
func FuzzClientServerArgv(f *testing.F) {
	for _, args := range [][]string{
		{"k8s:app=a b"},
		{"identity/allocate", "k8s:injected=yes"},
		{"k8s:pad=" + strings.Repeat("x", 4096-len(`["test/record","k8s:pad=`)), "test/record", "injected"},
		{"a\nb", "x\ntest/record injected\n"},
		{"$HOME", "${PATH}", "#", "# c", "'", "''", `"`, `\`, "&", "!", "[cond]"},
		{"", "\x00", "\t", "\r\n", "\u2028"},
		{"--", "-h", "--autocomplete=x"},
		{"żółw 🐢"},
		{"\xff\xfe"},
		{"k8s:v=" + strings.Repeat("v", 5000)},
	} {
		f.Add(append([]byte{0}, encodeArgv(args...)...))
	}
	f.Add(append([]byte{1}, encodeArgv("test/record", "a")...))
	f.Add(append([]byte{1}, encodeArgv("help")...))
	f.Add(append([]byte{1}, encodeArgv("test/record; test/record")...))
	f.Add(append([]byte{1}, encodeArgv("")...))
	f.Add([]byte{1})

	a := startAgent(f)
	c := dial(f, a)
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		var args []string
		if data[0]%2 == 0 {
			args = append([]string{"test/record"}, decodeArgv(data[1:])...)
		} else {
			args = decodeArgv(data[1:])
		}
		var out bytes.Buffer
		err := c.Run(t.Context(), &out, args...)
		runs := a.rec.take()

		_, encErr := shell.EncodeRequest(args)
		valid := len(args) > 0 && args[0] != ""
		for _, a := range args {
			valid = valid && utf8.ValidString(a)
		}
		switch {
		case !valid:
			if !errors.Is(err, shell.ErrBadRequest) {
				t.Fatalf("args %q: %v, want ErrBadRequest", args, err)
			}
		case errors.Is(encErr, shell.ErrRequestTooLarge):
			if !errors.Is(err, shell.ErrRequestTooLarge) {
				t.Fatalf("args of %d bytes: %v, want ErrRequestTooLarge", len(strings.Join(args, "")), err)
			}
		case args[0] == "test/record":
			want, _ := json.Marshal(args[1:])
			if err != nil || out.String() != string(want)+"\n" {
				t.Fatalf("args %q: %v, output %q", args, err, out.String())
			}
			if len(runs) != 1 || !slices.Equal(runs[0], args[1:]) {
				t.Fatalf("args %q: recorded %q, want the arguments exactly once", args, runs)
			}
			return
		default:
			var cmdErr *shell.CommandError
			if err != nil && !errors.As(err, &cmdErr) {
				t.Fatalf("args %q: %v: the connection broke", args, err)
			}
		}
		if len(runs) != 0 {
			t.Fatalf("args %q: recorded %q, want nothing", args, runs)
		}
	})
}
