package checkpoint

import (
	"bytes"
	"errors"
	"fmt"
	"hash/maphash"
	"math/bits"
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

	// seed hashes label sets to find duplicates; index holds the array
	// index of each restored identity, for reporting them.
	seed  maphash.Seed
	index []int
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
	// Sized for CIDR identities (~130 bytes each) to avoid most regrowth
	// without scanning the input twice.
	ids := make([]identity.Identity, 0, len(d.data)/128+1)
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
		if bad != nil {
			invalid = append(invalid, InvalidEntry{Index: index, ID: id, Reason: bad})
		} else {
			ids = append(ids, identity.Identity{ID: id, Labels: ls})
			d.index = append(d.index, index)
		}
		d.ws()
		switch d.peek() {
		case ',':
			d.pos++
		case ']':
			d.pos++
			ids, invalid = d.dropDuplicateSets(ids, invalid)
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

// setHash hashes a label set without building its canonical string.
func setHash(seed maphash.Seed, ls labels.Labels) uint64 {
	h := uint64(len(ls))
	for _, l := range ls {
		h = h*0x9E3779B97F4A7C15 ^ maphash.String(seed, l.Key)
		h = h*0x9E3779B97F4A7C15 ^ maphash.String(seed, l.Value)
		h = h*0x9E3779B97F4A7C15 ^ maphash.String(seed, l.Source)
	}
	return h
}

// dropDuplicateSets moves every identity whose label set repeats an earlier
// one to invalid. Files never hold duplicates in practice, so the common
// path is a pass over a bitset of hashes (far cheaper than a map or a sort
// of 100k hashes); only the sets whose bit was already taken are checked
// exactly.
func (d *decoder) dropDuplicateSets(ids []identity.Identity, invalid []InvalidEntry) ([]identity.Identity, []InvalidEntry) {
	if len(ids) < 2 {
		return ids, invalid
	}
	// About 16 bits per set keeps the sets whose bit is taken by another
	// to a few percent.
	nbits := uint64(1) << max(10, bits.Len64(uint64(len(ids))*16))
	set := make([]uint64, nbits/64)
	hashes := make([]uint64, len(ids))
	candidates := map[uint64]bool{}
	for i := range ids {
		h := setHash(d.seed, ids[i].Labels)
		hashes[i] = h
		b := h & (nbits - 1)
		if set[b/64]&(1<<(b%64)) != 0 {
			candidates[b] = true
		}
		set[b/64] |= 1 << (b % 64)
	}
	if len(candidates) == 0 {
		return ids, invalid
	}
	// Most candidates only share a bit; count the full hashes of those.
	full := make(map[uint64]int, 2*len(candidates))
	for i := range ids {
		if candidates[hashes[i]&(nbits-1)] {
			full[hashes[i]]++
		}
	}
	same := false
	for _, n := range full {
		same = same || n > 1
	}
	if !same {
		return ids, invalid
	}
	first := make(map[uint64][]int, 2*len(candidates))
	kept := ids[:0:0]
	dropped := false
	for i, id := range ids {
		if !candidates[hashes[i]&(nbits-1)] {
			kept = append(kept, id)
			continue
		}
		dup := -1
		for _, j := range first[hashes[i]] {
			if ids[j].Labels.Equal(id.Labels) {
				dup = j
				break
			}
		}
		if dup >= 0 {
			invalid = append(invalid, InvalidEntry{
				Index:  d.index[i],
				ID:     id.ID,
				Reason: fmt.Errorf("%w: same labels as id %d", ErrDuplicateSet, ids[dup].ID),
			})
			dropped = true
			continue
		}
		first[hashes[i]] = append(first[hashes[i]], i)
		kept = append(kept, id)
	}
	if !dropped {
		return ids, invalid
	}
	slices.SortFunc(invalid, func(a, b InvalidEntry) int { return a.Index - b.Index })
	return kept, invalid
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
	allReserved, hasHost := true, false
	if !plainLabels(ls) {
		// Only the rare label set with unusual bytes pays for the full
		// validation, which also gives the precise reason.
		if err := ls.Validate(); err != nil {
			return fmt.Errorf("%w: %w", ErrBadLabels, err)
		}
	} else {
		// Plain bytes say nothing of a cidr label's prefix, which the
		// allocator would refuse: check those labels alone.
		for _, l := range ls {
			if l.Source != labels.SourceCIDR {
				continue
			}
			if err := l.Validate(); err != nil {
				return fmt.Errorf("%w: %w", ErrBadLabels, err)
			}
		}
	}
	for _, l := range ls {
		allReserved = allReserved && l.Source == labels.SourceReserved
		hasHost = hasHost || l == labels.LabelHost
	}
	// A reserved identity has only reserved labels, or the host label:
	// skipping the lookup otherwise saves its searches for CIDR sets.
	if (allReserved || hasHost) && identity.LookupReserved(ls) != nil {
		return fmt.Errorf("%w: %s", ErrReservedSet, ls)
	}
	if s := identity.ScopeForLabels(ls); s != id.Scope() {
		return fmt.Errorf("%w: labels %s have scope %s, id %d has scope %s", ErrScopeMismatch, ls, s, id, id.Scope())
	}
	return nil
}

// plainLabels reports whether ls is certainly valid (labels.Labels.Validate
// would accept it): few enough labels, sorted unique non-empty keys, and
// only printable ASCII other than ';' in every part, no '=' in keys and no
// '/', ':' or leading '$' in sources. A false result says nothing: the
// caller runs the full validation. It is a single pass over the bytes,
// several times cheaper than the general check, which handles UTF-8.
func plainLabels(ls labels.Labels) bool {
	if len(ls) > labels.MaxLabels {
		return false
	}
	size := 0
	for i, l := range ls {
		if l.Key == "" || l.Source == "" || l.Source[0] == '$' {
			return false
		}
		if i > 0 && ls[i-1].Key >= l.Key {
			return false
		}
		if !plainString(l.Key, '=', ';') || !plainString(l.Value, ';', ';') || !plainSource(l.Source) {
			return false
		}
		size += len(l.Source) + len(l.Key) + len(l.Value) + 3
	}
	return size <= labels.MaxCanonicalBytes
}

func plainString(s string, bad1, bad2 byte) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < 0x20 || c >= 0x7f || c == bad1 || c == bad2 {
			return false
		}
	}
	return true
}

func plainSource(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < 0x20 || c >= 0x7f || c == ';' || c == '/' || c == ':' {
			return false
		}
	}
	return true
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
