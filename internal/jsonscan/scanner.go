// Package jsonscan reads JSON text in place, one value at a time, for
// hand-written decoders of a fixed schema: the decoder walks the input with
// Peek and the Read and Skip methods and decides itself what each object
// member means. Nothing is built that the decoder does not ask for: besides
// its errors, the scanner allocates only one buffer, reused, for strings
// with escapes.
//
// The scanner checks the syntax of everything it reads or skips against
// the grammar of RFC 8259 (it does not check that strings are valid UTF-8,
// as json.Valid does not) and never panics: any input, truncated or
// hostile, ends in a *SyntaxError with the offset where the text stopped
// being JSON. Skipped values nest at most MaxDepth deep.
package jsonscan

import (
	"bytes"
	"fmt"
	"unicode/utf16"
	"unicode/utf8"
)

// MaxDepth bounds the nesting of skipped values, so that a hostile input of
// brackets cannot exhaust memory through recursion.
const MaxDepth = 512

// SyntaxError is a JSON syntax error at a byte offset of the input.
type SyntaxError struct {
	Offset int
	Msg    string
}

func (e *SyntaxError) Error() string {
	return fmt.Sprintf("%s at offset %d", e.Msg, e.Offset)
}

// Scanner reads one JSON input. Its zero value reads an empty input; it is
// not safe for concurrent use.
type Scanner struct {
	data []byte
	pos  int
	// scratch holds unescaped strings, reused from one to the next.
	scratch []byte
}

// New returns a scanner at the start of data, which it reads in place:
// data must not change while the scanner is in use.
func New(data []byte) Scanner {
	return Scanner{data: data}
}

// Offset returns the offset of the next byte to read.
func (s *Scanner) Offset() int { return s.pos }

// AtEnd reports whether the whole input has been read.
func (s *Scanner) AtEnd() bool { return s.pos == len(s.data) }

// Fail returns a *SyntaxError with msg at the current offset.
func (s *Scanner) Fail(msg string) error {
	return &SyntaxError{Offset: s.pos, Msg: msg}
}

// SkipSpace moves past JSON whitespace.
func (s *Scanner) SkipSpace() {
	for s.pos < len(s.data) {
		switch s.data[s.pos] {
		case ' ', '\t', '\n', '\r':
			s.pos++
		default:
			return
		}
	}
}

// Peek returns the next byte without reading it, or 0 at the end of the
// input. Its value says what the next value is: '{', '[', '"', a number
// (see IsNumberStart) or the first letter of a literal.
func (s *Scanner) Peek() byte {
	if s.pos < len(s.data) {
		return s.data[s.pos]
	}
	return 0
}

// Advance moves past the byte that Peek returned.
func (s *Scanner) Advance() { s.pos++ }

// Literal moves past lit and reports true if the input continues with it;
// otherwise it reads nothing.
func (s *Scanner) Literal(lit string) bool {
	if bytes.HasPrefix(s.data[s.pos:], []byte(lit)) {
		s.pos += len(lit)
		return true
	}
	return false
}

// IsNumberStart reports whether c, as returned by Peek, starts a number.
func IsNumberStart(c byte) bool { return c == '-' || ('0' <= c && c <= '9') }

// EqualFold reports whether b equals lower, which must be in lower case,
// ignoring ASCII case: encoding/json matches member names the same way,
// for ASCII names.
func EqualFold(b []byte, lower string) bool {
	if len(b) != len(lower) {
		return false
	}
	for i := range len(b) {
		c := b[i]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != lower[i] {
			return false
		}
	}
	return true
}

// EachField reads the members of an object whose '{' was read, calling fn
// with each name (valid until the next string is read) with the scanner at
// the start of the member's value. fn must read or skip the value; an error
// it returns ends the object and is returned.
func (s *Scanner) EachField(fn func(name []byte) error) error {
	if s.Closing('}') {
		return nil
	}
	for {
		s.SkipSpace()
		if s.Peek() != '"' {
			return s.Fail("expected object key")
		}
		name, err := s.ReadString()
		if err != nil {
			return err
		}
		s.SkipSpace()
		if s.Peek() != ':' {
			return s.Fail("expected ':' after object key")
		}
		s.pos++
		s.SkipSpace()
		if err := fn(name); err != nil {
			return err
		}
		if more, err := s.More('}', "expected ',' or '}' in object"); !more {
			return err
		}
	}
}

// Closing moves past whitespace and then past end ('}' or ']') if it comes
// next, reporting whether it did: right after the opening bracket, that
// the object or array is empty.
func (s *Scanner) Closing(end byte) bool {
	s.SkipSpace()
	if s.Peek() == end {
		s.pos++
		return true
	}
	return false
}

// More moves past whitespace and the ',' that comes before another member
// or element (true), or past end ('}' or ']'), which closes the object or
// array (false). Anything else is a *SyntaxError with msg.
func (s *Scanner) More(end byte, msg string) (bool, error) {
	s.SkipSpace()
	switch s.Peek() {
	case ',':
		s.pos++
		return true, nil
	case end:
		s.pos++
		return false, nil
	}
	return false, s.Fail(msg)
}

// ReadNumber reads a number and returns its text.
func (s *Scanner) ReadNumber() ([]byte, error) {
	start := s.pos
	p := s.pos
	data := s.data
	if p < len(data) && data[p] == '-' {
		p++
	}
	switch {
	case p < len(data) && data[p] == '0':
		p++
	case p < len(data) && '1' <= data[p] && data[p] <= '9':
		p = skipDigits(data, p)
	default:
		s.pos = p
		return nil, s.Fail("invalid number")
	}
	var err error
	if p < len(data) && data[p] == '.' {
		if p, err = s.digits(p + 1); err != nil {
			return nil, err
		}
	}
	if p < len(data) && (data[p] == 'e' || data[p] == 'E') {
		p++
		if p < len(data) && (data[p] == '+' || data[p] == '-') {
			p++
		}
		if p, err = s.digits(p); err != nil {
			return nil, err
		}
	}
	s.pos = p
	return data[start:p], nil
}

// digits returns the end of the digits at p, of which a fraction or an
// exponent needs one at least.
func (s *Scanner) digits(p int) (int, error) {
	end := skipDigits(s.data, p)
	if end == p {
		s.pos = p
		return p, s.Fail("invalid number")
	}
	return end, nil
}

func skipDigits(data []byte, p int) int {
	for p < len(data) && '0' <= data[p] && data[p] <= '9' {
		p++
	}
	return p
}

// ReadString reads a string (Peek returned '"') and returns it unescaped.
// The result aliases the input when the string has no escapes, and a
// buffer of the scanner otherwise; either way it is valid only until the
// next string is read. A lone UTF-16 surrogate becomes U+FFFD; other bytes
// are returned as they are, valid UTF-8 or not.
func (s *Scanner) ReadString() ([]byte, error) {
	s.pos++
	start := s.pos
	data := s.data
	for p := start; p < len(data); p++ {
		switch c := data[p]; {
		case c == '"':
			s.pos = p + 1
			return data[start:p], nil
		case c == '\\':
			s.pos = p
			return s.readEscaped(start)
		case c < 0x20:
			s.pos = p
			return nil, s.Fail("control character in string")
		}
	}
	s.pos = len(data)
	return nil, s.Fail("unterminated string")
}

// readEscaped finishes ReadString from the first '\\' (at s.pos) of the
// string that starts at start.
func (s *Scanner) readEscaped(start int) ([]byte, error) {
	data := s.data
	out := append(s.scratch[:0], data[start:s.pos]...)
	p := s.pos
	for p < len(data) {
		c := data[p]
		switch {
		case c == '"':
			s.pos = p + 1
			s.scratch = out
			return out, nil
		case c < 0x20:
			s.pos = p
			return nil, s.Fail("control character in string")
		case c != '\\':
			out = append(out, c)
			p++
			continue
		}
		p++
		if p >= len(data) {
			break
		}
		switch e := data[p]; e {
		case '"', '\\', '/':
			out = append(out, e)
		case 'b':
			out = append(out, '\b')
		case 'f':
			out = append(out, '\f')
		case 'n':
			out = append(out, '\n')
		case 'r':
			out = append(out, '\r')
		case 't':
			out = append(out, '\t')
		case 'u':
			r, ok := hex4(data, p+1)
			if !ok {
				s.pos = p
				return nil, s.Fail("invalid \\u escape")
			}
			p += 4
			if utf16.IsSurrogate(r) {
				// A high surrogate followed by a low one is one
				// character; a lone surrogate becomes U+FFFD.
				if p+2 < len(data) && data[p+1] == '\\' && data[p+2] == 'u' {
					if r2, ok := hex4(data, p+3); ok {
						if dec := utf16.DecodeRune(r, r2); dec != utf8.RuneError {
							r = dec
							p += 6
						}
					}
				}
				if utf16.IsSurrogate(r) {
					r = utf8.RuneError
				}
			}
			out = utf8.AppendRune(out, r)
		default:
			s.pos = p
			return nil, s.Fail("invalid escape")
		}
		p++
	}
	s.pos = len(data)
	return nil, s.Fail("unterminated string")
}

func hex4(data []byte, p int) (rune, bool) {
	if p+4 > len(data) {
		return 0, false
	}
	var r rune
	for _, c := range data[p : p+4] {
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c -= 'a' - 10
		case 'A' <= c && c <= 'F':
			c -= 'A' - 10
		default:
			return 0, false
		}
		r = r<<4 | rune(c)
	}
	return r, true
}

// SkipValue reads any value, checking its syntax. depth is the nesting of
// the value in the input (0 for the top level): a value nested deeper than
// MaxDepth is an error.
func (s *Scanner) SkipValue(depth int) error {
	if depth > MaxDepth {
		return s.Fail("nesting too deep")
	}
	switch c := s.Peek(); {
	case c == '"':
		_, err := s.ReadString()
		return err
	case c == '{':
		s.pos++
		return s.EachField(func([]byte) error { return s.SkipValue(depth + 1) })
	case c == '[':
		s.pos++
		if s.Closing(']') {
			return nil
		}
		for {
			s.SkipSpace()
			if err := s.SkipValue(depth + 1); err != nil {
				return err
			}
			if more, err := s.More(']', "expected ',' or ']' in array"); !more {
				return err
			}
		}
	case IsNumberStart(c):
		_, err := s.ReadNumber()
		return err
	case c == 't':
		if s.Literal("true") {
			return nil
		}
	case c == 'f':
		if s.Literal("false") {
			return nil
		}
	case c == 'n':
		if s.Literal("null") {
			return nil
		}
	}
	if s.pos >= len(s.data) {
		return s.Fail("unexpected end of input")
	}
	return s.Fail("invalid character")
}
