package checkpoint

import (
	"bytes"
	"errors"
	"fmt"
	"hash/maphash"
	"slices"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// ErrCorrupt is wrapped by every error that makes a whole checkpoint
// unusable: it is not JSON, not an array, or larger than MaxFileSize.
var ErrCorrupt = errors.New("corrupt checkpoint")

// SyntaxError is a JSON syntax error at a byte offset of the checkpoint.
type SyntaxError struct {
	Offset int
	Msg    string
}

func (e *SyntaxError) Error() string {
	return fmt.Sprintf("corrupt checkpoint: %s at offset %d", e.Msg, e.Offset)
}

// Unwrap makes errors.Is(err, ErrCorrupt) true.
func (e *SyntaxError) Unwrap() error { return ErrCorrupt }

// InvalidEntry is an element of a checkpoint that is well-formed JSON but
// does not describe a restorable identity. It is skipped; the other
// elements are still restored.
type InvalidEntry struct {
	// Index is the element's position in the array, from 0.
	Index int
	// ID is the element's numeric ID, or 0 when it has none.
	ID identity.NumericIdentity
	// Reason says what is wrong.
	Reason error
}

func (e InvalidEntry) String() string {
	return fmt.Sprintf("entry %d (id %d): %s", e.Index, e.ID, e.Reason)
}

// Reasons of InvalidEntry. They are wrapped with details.
var (
	ErrNotObject     = errors.New("element is not an object")
	ErrBadID         = errors.New("invalid numeric id")
	ErrNotLocalScope = errors.New("id is not in a local scope")
	ErrBadLabels     = errors.New("invalid labels")
	ErrScopeMismatch = errors.New("scope of the labels does not match the id")
	ErrReservedSet   = errors.New("labels are a reserved identity")
	ErrDuplicateID   = errors.New("duplicate id")
	ErrDuplicateSet  = errors.New("duplicate label set")
)

// maxDepth bounds the nesting of skipped values, so that a hostile file of
// brackets cannot exhaust memory through recursion.
const maxDepth = 512

// Decode parses a checkpoint and validates each element. It accepts the
// elements and their fields in any order, any JSON whitespace, unknown
// fields (skipped), field names in any letter case, and labels in their
// object form or their short string form ("world":"reserved:world"). A
// literal null is an empty checkpoint.
//
// An element that is valid JSON but not a restorable identity is reported
// in invalid with its index and the others are returned: a numeric ID
// outside the local scopes, labels that do not parse or validate, labels
// whose scope differs from the ID's, a reserved label set, or a duplicate
// ID or label set. Any syntax error makes the whole input unusable: err
// wraps ErrCorrupt and ids is nil.
//
// Decode never panics, whatever the input.
func Decode(data []byte) (ids []identity.Identity, invalid []InvalidEntry, err error) {
	d := decoder{data: data}
	ids, invalid, err = d.decodeArray()
	if err != nil {
		return nil, nil, err
	}
	return ids, invalid, nil
}

type decoder struct {
	data []byte
	pos  int

	// scratch holds unescaped strings; labels collects one element's
	// labels before they are copied into their own slice.
	scratch []byte
	labels  []labels.Label

	// seenSets detects duplicate label sets by hash, with a compare on
	// collision, so that no canonical string is built per identity.
	seed     maphash.Seed
	seenSets map[uint64]int
}

func (d *decoder) syntax(msg string) error {
	return &SyntaxError{Offset: d.pos, Msg: msg}
}

func (d *decoder) ws() {
	for d.pos < len(d.data) {
		switch d.data[d.pos] {
		case ' ', '\t', '\n', '\r':
			d.pos++
		default:
			return
		}
	}
}

func (d *decoder) peek() byte {
	if d.pos < len(d.data) {
		return d.data[d.pos]
	}
	return 0
}

func (d *decoder) literal(lit string) bool {
	if bytes.HasPrefix(d.data[d.pos:], []byte(lit)) {
		d.pos += len(lit)
		return true
	}
	return false
}

func (d *decoder) decodeArray() ([]identity.Identity, []InvalidEntry, error) {
	d.ws()
	if d.pos == len(d.data) {
		return nil, nil, d.syntax("empty input")
	}
	if d.literal("null") {
		return d.end(nil, nil)
	}
	if d.peek() != '[' {
		return nil, nil, d.syntax("top level is not an array")
	}
	d.pos++
	// A rough count of the elements sizes the result at once.
	ids := make([]identity.Identity, 0, bytes.Count(d.data, []byte(`"id"`)))
	var invalid []InvalidEntry
	d.ws()
	if d.peek() == ']' {
		d.pos++
		return d.end(ids, invalid)
	}
	var (
		prev    identity.NumericIdentity
		ordered = true
		seenIDs map[identity.NumericIdentity]int
	)
	d.seed = maphash.MakeSeed()
	d.seenSets = make(map[uint64]int, cap(ids))
	for index := 0; ; index++ {
		d.ws()
		id, ls, bad, err := d.decodeElement()
		if err != nil {
			return nil, nil, err
		}
		if bad == nil {
			bad = validate(id, ls)
		}
		if bad == nil {
			// The file is normally sorted by ID: a strictly
			// increasing ID cannot repeat an earlier one, so the
			// map is needed only for files written in another
			// order.
			if ordered && id <= prev {
				ordered = false
				seenIDs = make(map[identity.NumericIdentity]int, len(ids))
				for i, x := range ids {
					seenIDs[x.ID] = i
				}
			}
			prev = id
			if !ordered {
				if first, dup := seenIDs[id]; dup {
					bad = fmt.Errorf("%w: also at restored entry %d", ErrDuplicateID, first)
				} else {
					seenIDs[id] = len(ids)
				}
			}
		}
		if bad == nil {
			bad = d.checkDuplicateSet(ids, ls)
		}
		if bad != nil {
			invalid = append(invalid, InvalidEntry{Index: index, ID: id, Reason: bad})
		} else {
			ids = append(ids, identity.Identity{ID: id, Labels: ls})
		}
		d.ws()
		switch d.peek() {
		case ',':
			d.pos++
		case ']':
			d.pos++
			return d.end(ids, invalid)
		default:
			return nil, nil, d.syntax("expected ',' or ']' after array element")
		}
	}
}

func (d *decoder) end(ids []identity.Identity, invalid []InvalidEntry) ([]identity.Identity, []InvalidEntry, error) {
	d.ws()
	if d.pos != len(d.data) {
		return nil, nil, d.syntax("data after the array")
	}
	if ids == nil {
		ids = []identity.Identity{}
	}
	return ids, invalid, nil
}

func (d *decoder) checkDuplicateSet(ids []identity.Identity, ls labels.Labels) error {
	var h maphash.Hash
	h.SetSeed(d.seed)
	for _, l := range ls {
		h.WriteString(l.Source)
		h.WriteByte(0)
		h.WriteString(l.Key)
		h.WriteByte(0)
		h.WriteString(l.Value)
		h.WriteByte(0)
	}
	sum := h.Sum64()
	if i, ok := d.seenSets[sum]; ok && ids[i].Labels.Equal(ls) {
		return fmt.Errorf("%w: same labels as id %d", ErrDuplicateSet, ids[i].ID)
	}
	// On a hash collision between different sets the later one wins the
	// slot; a duplicate of the earlier one could then go unnoticed, which
	// the allocator tolerates (it returns the existing identity).
	d.seenSets[sum] = len(ids)
	return nil
}

// validate checks what the allocator would otherwise refuse or mishandle
// on restoration.
func validate(id identity.NumericIdentity, ls labels.Labels) error {
	if !id.HasLocalScope() || id&^identity.ScopeMask == 0 {
		return fmt.Errorf("%w: %d (scope %s)", ErrNotLocalScope, id, id.Scope())
	}
	if len(ls) == 0 {
		return fmt.Errorf("%w: no labels", ErrBadLabels)
	}
	if err := ls.Validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrBadLabels, err)
	}
	if identity.LookupReserved(ls) != nil {
		return fmt.Errorf("%w: %s", ErrReservedSet, ls)
	}
	if s := identity.ScopeForLabels(ls); s != id.Scope() {
		return fmt.Errorf("%w: labels %s have scope %s, id %d has scope %s", ErrScopeMismatch, ls, s, id, id.Scope())
	}
	return nil
}

// decodeElement parses one array element. bad is set when the element is
// valid JSON but not an identity; err only for syntax errors.
func (d *decoder) decodeElement() (id identity.NumericIdentity, ls labels.Labels, bad, err error) {
	if d.peek() != '{' {
		if err := d.skipValue(0); err != nil {
			return 0, nil, nil, err
		}
		return 0, nil, ErrNotObject, nil
	}
	d.pos++
	// A repeated field replaces the earlier one, as in encoding/json, so
	// each field keeps its own verdict.
	haveID, haveLabels := false, false
	var idErr, labelsErr error
	err = d.eachField(func(name []byte) error {
		switch {
		case asciiEqualFold(name, "id"):
			haveID = true
			v, ok, err := d.number()
			if err != nil {
				return err
			}
			idErr = nil
			if !ok {
				idErr = fmt.Errorf("%w: not a 32-bit unsigned integer", ErrBadID)
			}
			id = identity.NumericIdentity(v)
		case asciiEqualFold(name, "labels"):
			haveLabels = true
			var err error
			ls, labelsErr, err = d.labelMap()
			return err
		default:
			return d.skipValue(1)
		}
		return nil
	})
	if err != nil {
		return 0, nil, nil, err
	}
	switch {
	case idErr != nil:
		bad = idErr
	case labelsErr != nil:
		bad = labelsErr
	case !haveID:
		bad = fmt.Errorf("%w: missing", ErrBadID)
	case !haveLabels:
		bad = fmt.Errorf("%w: missing", ErrBadLabels)
	}
	return id, ls, bad, nil
}

// eachField parses the members of an object whose '{' was consumed,
// calling fn with each name (valid until the next string is read) and the
// position at the start of its value. fn must consume the value.
func (d *decoder) eachField(fn func(name []byte) error) error {
	d.ws()
	if d.peek() == '}' {
		d.pos++
		return nil
	}
	for {
		d.ws()
		if d.peek() != '"' {
			return d.syntax("expected object key")
		}
		name, err := d.str()
		if err != nil {
			return err
		}
		d.ws()
		if d.peek() != ':' {
			return d.syntax("expected ':' after object key")
		}
		d.pos++
		d.ws()
		if err := fn(name); err != nil {
			return err
		}
		d.ws()
		switch d.peek() {
		case ',':
			d.pos++
		case '}':
			d.pos++
			return nil
		default:
			return d.syntax("expected ',' or '}' in object")
		}
	}
}

// labelMap parses the "labels" value. lerr reports labels that are
// well-formed JSON but not valid labels.
func (d *decoder) labelMap() (ls labels.Labels, lerr, err error) {
	switch d.peek() {
	case '{':
	case 'n':
		if d.literal("null") {
			return nil, nil, nil
		}
		return nil, nil, d.syntax("invalid literal")
	default:
		if err := d.skipValue(1); err != nil {
			return nil, nil, err
		}
		return nil, fmt.Errorf("%w: not an object", ErrBadLabels), nil
	}
	d.pos++
	d.labels = d.labels[:0]
	err = d.eachField(func(name []byte) error {
		mapKey := internKey(name)
		l, lbad, err := d.label(mapKey)
		if err != nil {
			return err
		}
		if lbad != nil {
			if lerr == nil {
				lerr = fmt.Errorf("%w: label %q: %w", ErrBadLabels, mapKey, lbad)
			}
			return nil
		}
		if len(d.labels) >= labels.MaxLabels+1 {
			// Validate reports the limit; collecting more
			// would only cost memory.
			return nil
		}
		d.labels = append(d.labels, l)
		return nil
	})
	if err != nil || lerr != nil {
		return nil, lerr, err
	}
	ls = make(labels.Labels, len(d.labels))
	copy(ls, d.labels)
	if !slices.IsSortedFunc(ls, compareKeys) {
		slices.SortFunc(ls, compareKeys)
	}
	return ls, nil, nil
}

// label parses one value of the label map: an object with key, value and
// source, or the short string form "source:key=value".
func (d *decoder) label(mapKey string) (l labels.Label, bad, err error) {
	switch d.peek() {
	case '"':
		s, err := d.str()
		if err != nil {
			return l, nil, err
		}
		l, perr := labels.ParseLabel(string(s))
		if perr != nil {
			return l, perr, nil
		}
		if l.Key != mapKey {
			return l, fmt.Errorf("key %q differs from its map key", l.Key), nil
		}
		return l, nil, nil
	case '{':
		d.pos++
	default:
		if err := d.skipValue(2); err != nil {
			return l, nil, err
		}
		return l, errors.New("not an object or string"), nil
	}
	const (
		fieldKey = iota
		fieldValue
		fieldSource
	)
	haveKey := false
	err = d.eachField(func(name []byte) error {
		var field int
		switch {
		case asciiEqualFold(name, "key"):
			field, haveKey = fieldKey, true
		case asciiEqualFold(name, "value"):
			field = fieldValue
		case asciiEqualFold(name, "source"):
			field = fieldSource
		default:
			return d.skipValue(3)
		}
		var s []byte
		switch d.peek() {
		case '"':
			var err error
			if s, err = d.str(); err != nil {
				return err
			}
		case 'n':
			if !d.literal("null") {
				return d.syntax("invalid literal")
			}
		default:
			if bad == nil {
				bad = fmt.Errorf("field %q is not a string", name)
			}
			return d.skipValue(3)
		}
		switch field {
		case fieldKey:
			// The key is nearly always the map key: share its
			// string instead of allocating another.
			if string(s) == mapKey {
				l.Key = mapKey
			} else {
				l.Key = string(s)
			}
		case fieldSource:
			l.Source = internSource(s)
		default:
			l.Value = string(s)
		}
		return nil
	})
	if err != nil || bad != nil {
		return l, bad, err
	}
	if !haveKey || l.Key == "" {
		l.Key = mapKey
	}
	if l.Key != mapKey {
		return l, fmt.Errorf("key %q differs from its map key", l.Key), nil
	}
	if l.Source == "" {
		l.Source = labels.SourceUnspec
	}
	return l, nil, nil
}

// internSource returns the package constant for a known source, so that
// decoding does not allocate a string for each label's source.
func internSource(b []byte) string {
	switch string(b) {
	case labels.SourceCIDR:
		return labels.SourceCIDR
	case labels.SourceReserved:
		return labels.SourceReserved
	case labels.SourceFQDN:
		return labels.SourceFQDN
	case labels.SourceK8s:
		return labels.SourceK8s
	case labels.SourceUnspec:
		return labels.SourceUnspec
	}
	return string(b)
}

// internKey does the same for the keys of reserved labels, which most
// local identities carry.
func internKey(b []byte) string {
	switch string(b) {
	case labels.IDNameWorld:
		return labels.IDNameWorld
	case labels.IDNameWorldIPv4:
		return labels.IDNameWorldIPv4
	case labels.IDNameWorldIPv6:
		return labels.IDNameWorldIPv6
	case labels.IDNameRemoteNode:
		return labels.IDNameRemoteNode
	}
	return string(b)
}

func asciiEqualFold(b []byte, s string) bool {
	if len(b) != len(s) {
		return false
	}
	for i := range len(b) {
		c := b[i]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != s[i] {
			return false
		}
	}
	return true
}

// number parses a JSON number. ok is false when it is valid JSON but not
// an integer in the range of uint32.
func (d *decoder) number() (v uint32, ok bool, err error) {
	start := d.pos
	if start < len(d.data) && !isNumberStart(d.data[start]) {
		// Another JSON type: a wrong type, not a syntax error.
		return 0, false, d.skipValue(1)
	}
	if err := d.skipNumber(); err != nil {
		return 0, false, err
	}
	digits := d.data[start:d.pos]
	if len(digits) > 10 {
		return 0, false, nil
	}
	var n uint64
	for _, c := range digits {
		if c < '0' || c > '9' {
			return 0, false, nil
		}
		n = n*10 + uint64(c-'0')
	}
	if n > 1<<32-1 {
		return 0, false, nil
	}
	return uint32(n), true, nil
}

func isNumberStart(c byte) bool { return c == '-' || ('0' <= c && c <= '9') }

func (d *decoder) skipNumber() error {
	p := d.pos
	data := d.data
	if p < len(data) && data[p] == '-' {
		p++
	}
	switch {
	case p < len(data) && data[p] == '0':
		p++
	case p < len(data) && '1' <= data[p] && data[p] <= '9':
		for p < len(data) && '0' <= data[p] && data[p] <= '9' {
			p++
		}
	default:
		d.pos = p
		return d.syntax("invalid number")
	}
	if p < len(data) && data[p] == '.' {
		p++
		if p >= len(data) || data[p] < '0' || data[p] > '9' {
			d.pos = p
			return d.syntax("invalid number")
		}
		for p < len(data) && '0' <= data[p] && data[p] <= '9' {
			p++
		}
	}
	if p < len(data) && (data[p] == 'e' || data[p] == 'E') {
		p++
		if p < len(data) && (data[p] == '+' || data[p] == '-') {
			p++
		}
		if p >= len(data) || data[p] < '0' || data[p] > '9' {
			d.pos = p
			return d.syntax("invalid number")
		}
		for p < len(data) && '0' <= data[p] && data[p] <= '9' {
			p++
		}
	}
	d.pos = p
	return nil
}

// str parses a JSON string at d.pos (which holds '"'). The result aliases
// the input when the string has no escapes, and the scratch buffer
// otherwise; either way it is valid only until the next call.
func (d *decoder) str() ([]byte, error) {
	d.pos++
	start := d.pos
	data := d.data
	for p := start; p < len(data); p++ {
		switch c := data[p]; {
		case c == '"':
			d.pos = p + 1
			return data[start:p], nil
		case c == '\\':
			d.pos = p
			return d.strEscaped(start)
		case c < 0x20:
			d.pos = p
			return nil, d.syntax("control character in string")
		}
	}
	d.pos = len(data)
	return nil, d.syntax("unterminated string")
}

func (d *decoder) strEscaped(start int) ([]byte, error) {
	data := d.data
	out := append(d.scratch[:0], data[start:d.pos]...)
	p := d.pos
	for p < len(data) {
		c := data[p]
		switch {
		case c == '"':
			d.pos = p + 1
			d.scratch = out
			return out, nil
		case c < 0x20:
			d.pos = p
			return nil, d.syntax("control character in string")
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
				d.pos = p
				return nil, d.syntax("invalid \\u escape")
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
			d.pos = p
			return nil, d.syntax("invalid escape")
		}
		p++
	}
	d.pos = len(data)
	return nil, d.syntax("unterminated string")
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

// skipValue consumes any JSON value, checking its syntax.
func (d *decoder) skipValue(depth int) error {
	if depth > maxDepth {
		return d.syntax("nesting too deep")
	}
	switch c := d.peek(); {
	case c == '"':
		_, err := d.str()
		return err
	case c == '{':
		d.pos++
		return d.eachField(func([]byte) error { return d.skipValue(depth + 1) })
	case c == '[':
		d.pos++
		d.ws()
		if d.peek() == ']' {
			d.pos++
			return nil
		}
		for {
			d.ws()
			if err := d.skipValue(depth + 1); err != nil {
				return err
			}
			d.ws()
			switch d.peek() {
			case ',':
				d.pos++
			case ']':
				d.pos++
				return nil
			default:
				return d.syntax("expected ',' or ']' in array")
			}
		}
	case isNumberStart(c):
		return d.skipNumber()
	case c == 't':
		if d.literal("true") {
			return nil
		}
	case c == 'f':
		if d.literal("false") {
			return nil
		}
	case c == 'n':
		if d.literal("null") {
			return nil
		}
	}
	if d.pos >= len(d.data) {
		return d.syntax("unexpected end of input")
	}
	return d.syntax("invalid character")
}
