package shell

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"unicode/utf8"
)

// MaxRequestBytes is the largest request the shell takes: the JSON text of
// one command's argument vector, without its newline. A label set is at
// most 16 KiB (labels.MaxCanonicalBytes), so this leaves room for many
// labels or prefixes in one command while bounding what one connection can
// make the agent hold.
const MaxRequestBytes = 1 << 20

// ErrRequestTooLarge is wrapped by the error for a request longer than
// MaxRequestBytes. Such a request is refused whole: no part of it runs.
var ErrRequestTooLarge = errors.New("shell request too large")

// ErrBadRequest is wrapped by the error for a request that is not a
// non-empty JSON array of strings in UTF-8.
var ErrBadRequest = errors.New("bad shell request")

// frame is one line of the server's answer. Output frames come as the
// command writes; exactly one frame with End set closes the answer.
type frame struct {
	Output string `json:"output,omitempty"`
	// End is "ok" or "error"; empty in output frames.
	End   string `json:"end,omitempty"`
	Error string `json:"error,omitempty"`
}

const (
	endOK    = "ok"
	endError = "error"
)

// EncodeRequest returns the request line (with its newline) that runs
// args[0] with the arguments args[1:], exactly as given. It refuses,
// instead of altering, what the server would refuse: no arguments,
// arguments that are not UTF-8, and requests over MaxRequestBytes.
func EncodeRequest(args []string) ([]byte, error) {
	if len(args) == 0 || args[0] == "" {
		return nil, fmt.Errorf("%w: no command", ErrBadRequest)
	}
	for i, a := range args {
		if !utf8.ValidString(a) {
			// encoding/json would write U+FFFD in place of the bad bytes.
			return nil, fmt.Errorf("%w: argument %d (%.40q) is not valid UTF-8", ErrBadRequest, i, a)
		}
	}
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(args); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadRequest, err)
	}
	// Encode ends the JSON text with the newline that ends the request.
	if n := b.Len() - 1; n > MaxRequestBytes {
		return nil, tooLarge(n)
	}
	return b.Bytes(), nil
}

func tooLarge(n int) error {
	return fmt.Errorf("%w: %d bytes, at most %d allowed; nothing ran", ErrRequestTooLarge, n, MaxRequestBytes)
}

// readRequest reads one request line. A line over MaxRequestBytes is read
// to its end and dropped, so the next request starts at a request
// boundary; a connection that ends inside a line runs nothing of it.
func readRequest(r *bufio.Reader) ([]byte, error) {
	var line []byte
	size := 0
	for {
		chunk, err := r.ReadSlice('\n')
		size += len(chunk)
		if size <= MaxRequestBytes+1 {
			line = append(line, chunk...)
		}
		switch {
		case err == nil:
			if size-1 > MaxRequestBytes {
				return nil, tooLarge(size - 1)
			}
			return line[:len(line)-1], nil
		case errors.Is(err, bufio.ErrBufferFull):
			continue
		default:
			return nil, err
		}
	}
}

// decodeRequest reads the argument vector of one request line. Whatever
// encoding/json would decode into something other than what was sent is
// refused: bytes that are not UTF-8, escapes of lone UTF-16 surrogates
// (both become U+FFFD) and null elements (which become "").
func decodeRequest(line []byte) ([]string, error) {
	if !utf8.Valid(line) {
		return nil, fmt.Errorf("%w: not valid UTF-8", ErrBadRequest)
	}
	var raw []json.RawMessage
	if err := json.Unmarshal(line, &raw); err != nil {
		return nil, fmt.Errorf("%w: want a JSON array of strings, [\"command\", \"argument\", ...]: %w", ErrBadRequest, err)
	}
	if len(raw) == 0 {
		return nil, fmt.Errorf("%w: no command", ErrBadRequest)
	}
	if loneSurrogate(line) {
		return nil, fmt.Errorf("%w: an escape of a lone UTF-16 surrogate (\\ud800-\\udfff) stands for no character", ErrBadRequest)
	}
	args := make([]string, len(raw))
	for i, r := range raw {
		if len(r) == 0 || r[0] != '"' {
			return nil, fmt.Errorf("%w: element %d is %.40s, not a string", ErrBadRequest, i, r)
		}
		if err := json.Unmarshal(r, &args[i]); err != nil {
			return nil, fmt.Errorf("%w: element %d: %w", ErrBadRequest, i, err)
		}
	}
	if args[0] == "" {
		return nil, fmt.Errorf("%w: empty command name", ErrBadRequest)
	}
	return args, nil
}

// loneSurrogate reports whether valid JSON text holds a \u escape of a
// UTF-16 surrogate that is not half of a high-low pair. In valid JSON every
// backslash starts an escape inside a string, so a plain scan suffices.
func loneSurrogate(b []byte) bool {
	for i := 0; i < len(b); i++ {
		if b[i] != '\\' {
			continue
		}
		r := hexEscape(b[i:])
		switch {
		case r < 0:
			i++ // a one-character escape such as \" or \\
		case r >= 0xd800 && r < 0xdc00:
			if low := hexEscape(b[min(i+6, len(b)):]); low < 0xdc00 || low > 0xdfff {
				return true
			}
			i += 11
		case r >= 0xdc00 && r <= 0xdfff:
			return true
		default:
			i += 5
		}
	}
	return false
}

// hexEscape returns the code unit of a \uXXXX escape at the start of b, or
// -1 if b does not start with one.
func hexEscape(b []byte) int {
	if len(b) < 6 || b[0] != '\\' || b[1] != 'u' {
		return -1
	}
	v := 0
	for _, c := range b[2:6] {
		switch {
		case c >= '0' && c <= '9':
			v = v<<4 | int(c-'0')
		case c >= 'a' && c <= 'f':
			v = v<<4 | int(c-'a'+10)
		case c >= 'A' && c <= 'F':
			v = v<<4 | int(c-'A'+10)
		default:
			return -1
		}
	}
	return v
}
