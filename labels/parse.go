package labels

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"unicode/utf8"
)

// Reasons a label is refused. InvalidLabelError wraps one of them, so callers
// can test with errors.Is.
var (
	ErrEmptyKey        = errors.New("empty key")
	ErrEmptySource     = errors.New("empty source")
	ErrEqualsInKey     = errors.New("'=' in key")
	ErrSemicolon       = errors.New("';' is not allowed")
	ErrBadSource       = errors.New("source contains '/' or ':'")
	ErrControlChar     = errors.New("control character")
	ErrInvalidUTF8     = errors.New("invalid UTF-8")
	ErrDuplicateKey    = errors.New("duplicate key")
	ErrUnsorted        = errors.New("labels not sorted by key")
	ErrMissingTerminal = errors.New("canonical string does not end with ';'")
	ErrMissingEquals   = errors.New("canonical label has no '='")
	ErrMissingColon    = errors.New("canonical label has no ':'")
	// ErrBadCIDR: a cidr label whose key is not a masked IP prefix written
	// as CIDRKey writes it (the error says how it would be written), or
	// which has a value. One prefix has exactly one cidr label, so a
	// prefix's identity cannot be split between spellings.
	ErrBadCIDR = errors.New("bad cidr label")
)

// InvalidLabelError says which label was refused and why.
type InvalidLabelError struct {
	// Label is the offending label in text form (or the raw input).
	Label string
	// Reason is one of the Err* values of this package.
	Reason error
}

func (e *InvalidLabelError) Error() string {
	return fmt.Sprintf("invalid label %q: %s", e.Label, e.Reason)
}

func (e *InvalidLabelError) Unwrap() error { return e.Reason }

// ErrLimit is wrapped by every LimitError.
var ErrLimit = errors.New("label set exceeds a limit")

// LimitError says which limit of a label set was exceeded.
type LimitError struct {
	What  string
	Limit int
	Got   int
}

func (e *LimitError) Error() string {
	return fmt.Sprintf("label set has %d %s, at most %d allowed", e.Got, e.What, e.Limit)
}

func (e *LimitError) Unwrap() error { return ErrLimit }

// Validate checks that the label can round-trip through both the text and
// the canonical form.
func (l Label) Validate() error {
	if err := l.check(); err != nil {
		return &InvalidLabelError{Label: l.String(), Reason: err}
	}
	return nil
}

// check is Validate without building the error, in one pass over each
// field: it runs for every new identity.
func (l Label) check() error {
	switch {
	case l.Key == "":
		return ErrEmptyKey
	case l.Source == "":
		return ErrEmptySource
	case l.Source[0] == '$':
		// A leading '$' in the text form means "reserved", so such a
		// source would read back differently.
		return ErrBadSource
	}
	if err := checkField(l.Source, true, false); err != nil {
		return err
	}
	if err := checkField(l.Key, false, true); err != nil {
		return err
	}
	if err := checkField(l.Value, false, false); err != nil {
		return err
	}
	if l.Source == SourceCIDR {
		return checkCIDR(l.Key, l.Value)
	}
	return nil
}

// checkCIDR checks that a cidr label is what FromPrefix makes for some
// prefix: the key CIDRKey writes (masked, IPv6 with '-' for ':', no zone)
// and no value, as Cilium writes them.
func checkCIDR(key, value string) error {
	if value != "" {
		return fmt.Errorf("%w: a cidr label has no value", ErrBadCIDR)
	}
	if masked, ok := parseIPv4Prefix(key); ok {
		// The common case, every new IPv4 CIDR identity: decided
		// without netip's parse and formatting.
		if masked {
			return nil
		}
		return fmt.Errorf("%w: key %q is not in canonical form, want %q", ErrBadCIDR, key, CIDRKey(netip.MustParsePrefix(key)))
	}
	text := key
	dashed := strings.IndexByte(key, '-') >= 0
	if dashed {
		text = strings.ReplaceAll(key, "-", ":")
	}
	p, err := netip.ParsePrefix(text)
	if err != nil {
		return fmt.Errorf("%w: key %q is not an IP prefix (want e.g. 10.0.0.0/8 or 2001-db8--0/32)", ErrBadCIDR, key)
	}
	// An IPv4 prefix that netip parses has no leading zeros, so a masked
	// one is in canonical form: no key to build for the common case.
	if !dashed && p.Addr().Is4() && p.Masked() == p {
		return nil
	}
	if want := CIDRKey(p); want != key {
		return fmt.Errorf("%w: key %q is not in canonical form, want %q", ErrBadCIDR, key, want)
	}
	return nil
}

// parseIPv4Prefix reports whether s is an IPv4 prefix in the form
// netip.Prefix.String writes (four decimal octets without leading zeros,
// '/', a length of 0..32 without leading zeros) and whether its address is
// masked to its length. ok is false for anything else, which the caller
// hands to netip.
func parseIPv4Prefix(s string) (masked, ok bool) {
	var addr uint32
	i := 0
	for octet := range 4 {
		if octet > 0 {
			if i >= len(s) || s[i] != '.' {
				return false, false
			}
			i++
		}
		v, n, good := parseDecimal(s[i:], 255)
		if !good {
			return false, false
		}
		addr = addr<<8 | uint32(v)
		i += n
	}
	if i >= len(s) || s[i] != '/' {
		return false, false
	}
	bits, n, good := parseDecimal(s[i+1:], 32)
	if !good || i+1+n != len(s) {
		return false, false
	}
	var hostMask uint32 = 0xffffffff
	if bits > 0 {
		hostMask = uint32(1)<<(32-bits) - 1
	}
	return addr&hostMask == 0, true
}

// parseDecimal reads the decimal number at the start of s, of at most
// three digits, without a leading zero, at most limit; n is its length.
func parseDecimal(s string, limit int) (v, n int, ok bool) {
	for n < len(s) && n < 4 && s[n] >= '0' && s[n] <= '9' {
		v = v*10 + int(s[n]-'0')
		n++
	}
	if n == 0 || n > 3 || (n > 1 && s[0] == '0') || v > limit {
		return 0, 0, false
	}
	return v, n, true
}

// Byte classes for checkField: one table lookup per byte instead of a
// chain of comparisons, since every new identity's labels pass through it.
const (
	classControl = 1 << iota
	classSemicolon
	classEquals
	classSourceSep // '/' or ':', not allowed in a source
	classHigh      // part of a multi-byte UTF-8 sequence
)

var byteClass = func() (t [256]uint8) {
	for c := range 256 {
		switch {
		case c < 0x20 || c == 0x7f:
			t[c] = classControl
		case c == ';':
			t[c] = classSemicolon
		case c == '=':
			t[c] = classEquals
		case c == '/' || c == ':':
			t[c] = classSourceSep
		case c >= 0x80:
			t[c] = classHigh
		}
	}
	return t
}()

func checkField(s string, isSource, isKey bool) error {
	var seen uint8
	for i := 0; i < len(s); i++ {
		seen |= byteClass[s[i]]
	}
	if seen == 0 {
		return nil
	}
	switch {
	case seen&classControl != 0:
		return ErrControlChar
	case seen&classSemicolon != 0:
		return ErrSemicolon
	case seen&classEquals != 0 && isKey:
		return ErrEqualsInKey
	case seen&classSourceSep != 0 && isSource:
		return ErrBadSource
	}
	if seen&classHigh != 0 {
		if !utf8.ValidString(s) {
			return ErrInvalidUTF8
		}
		for _, r := range s {
			if r >= 0x80 && r < 0xa0 { // C1 control characters
				return ErrControlChar
			}
		}
	}
	return nil
}

// ParseLabel reads one label in text form: `source:key=value`. The source is
// the text before the first ':' (none means SourceUnspec, a leading '$' means
// SourceReserved); key and value split at the first '='.
func ParseLabel(s string) (Label, error) {
	var l Label
	rest := s
	switch {
	case strings.HasPrefix(s, "$"):
		l.Source, rest = SourceReserved, s[1:]
	default:
		if src, after, ok := strings.Cut(s, ":"); ok {
			l.Source, rest = src, after
		} else {
			l.Source = SourceUnspec
		}
	}
	if l.Source == "" {
		l.Source = SourceUnspec
	}
	l.Key, l.Value, _ = strings.Cut(rest, "=")
	if err := l.Validate(); err != nil {
		var ile *InvalidLabelError
		if errors.As(err, &ile) {
			ile.Label = s
		}
		return Label{}, err
	}
	return l, nil
}

// Parse builds a label set from labels in text form.
func Parse(strs ...string) (Labels, error) {
	ls := make([]Label, 0, len(strs))
	for _, s := range strs {
		l, err := ParseLabel(s)
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
	}
	return New(ls...)
}

// MustParse is Parse for label sets written in code; it panics on error.
func MustParse(strs ...string) Labels {
	ls, err := Parse(strs...)
	if err != nil {
		panic(err)
	}
	return ls
}

// ParseList reads the printable form written by Labels.String: text-form
// labels separated by ','. Labels whose values contain ',' cannot be given
// this way; use Parse with separate arguments.
func ParseList(s string) (Labels, error) {
	if s == "" {
		return Labels{}, nil
	}
	return Parse(strings.Split(s, ",")...)
}

// ParseCanonical reads a canonical string (`source:key=value;` per label, in
// key order) as stored in etcd. Out-of-order or duplicate keys are errors, so
// that a set has exactly one canonical string.
func ParseCanonical(s string) (Labels, error) {
	if s == "" {
		return Labels{}, nil
	}
	if !strings.HasSuffix(s, ";") {
		return nil, &InvalidLabelError{Label: s, Reason: ErrMissingTerminal}
	}
	n := strings.Count(s, ";")
	if n > MaxLabels {
		return nil, &LimitError{What: "labels", Limit: MaxLabels, Got: n}
	}
	out := make(Labels, 0, n)
	for part := range strings.SplitSeq(s[:len(s)-1], ";") {
		src, rest, ok := strings.Cut(part, ":")
		if !ok {
			return nil, &InvalidLabelError{Label: part, Reason: ErrMissingColon}
		}
		key, value, ok := strings.Cut(rest, "=")
		if !ok {
			return nil, &InvalidLabelError{Label: part, Reason: ErrMissingEquals}
		}
		out = append(out, Label{Source: src, Key: key, Value: value})
	}
	if err := out.Validate(); err != nil {
		return nil, err
	}
	return out, nil
}
