package checkpoint

import (
	"errors"
	"fmt"
	"hash/maphash"
	"slices"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/jsonscan"
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
	d := decoder{scan: jsonscan.New(data)}
	ids, invalid, err = d.decodeArray(len(data))
	if err != nil {
		var serr *jsonscan.SyntaxError
		if errors.As(err, &serr) {
			err = &SyntaxError{Offset: serr.Offset, Msg: serr.Msg}
		}
		return nil, nil, err
	}
	return ids, invalid, nil
}

// decoder reads the checkpoint schema from a JSON scanner.
type decoder struct {
	scan jsonscan.Scanner

	// labels collects one element's labels before they are copied into
	// their own slice.
	labels []labels.Label

	// seed hashes label sets to find duplicates; index holds the array
	// index of each restored identity, for reporting them.
	seed  maphash.Seed
	index []int
}

// decodeArray decodes the whole input, of size bytes: the top-level array
// (or null) and nothing after it.
func (d *decoder) decodeArray(size int) ([]identity.Identity, []InvalidEntry, error) {
	d.scan.SkipSpace()
	if d.scan.AtEnd() {
		return nil, nil, d.scan.Fail("empty input")
	}
	if d.scan.Literal("null") {
		return d.end(nil, nil)
	}
	if d.scan.Peek() != '[' {
		return nil, nil, d.scan.Fail("top level is not an array")
	}
	d.scan.Advance()
	// Sized for CIDR identities (~130 bytes each) to avoid most regrowth
	// without scanning the input twice.
	ids := make([]identity.Identity, 0, size/128+1)
	var invalid []InvalidEntry
	if d.scan.Closing(']') {
		return d.end(ids, invalid)
	}
	var (
		prev    identity.NumericIdentity
		ordered = true
		seenIDs map[identity.NumericIdentity]int
	)
	d.seed = maphash.MakeSeed()
	for index := 0; ; index++ {
		d.scan.SkipSpace()
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
		more, err := d.scan.More(']', "expected ',' or ']' after array element")
		if err != nil {
			return nil, nil, err
		}
		if !more {
			ids, invalid = d.dropDuplicateSets(ids, invalid)
			return d.end(ids, invalid)
		}
	}
}

func (d *decoder) end(ids []identity.Identity, invalid []InvalidEntry) ([]identity.Identity, []InvalidEntry, error) {
	d.scan.SkipSpace()
	if !d.scan.AtEnd() {
		return nil, nil, d.scan.Fail("data after the array")
	}
	if ids == nil {
		ids = []identity.Identity{}
	}
	return ids, invalid, nil
}

// decodeElement parses one array element. bad is set when the element is
// valid JSON but not an identity; err only for syntax errors.
func (d *decoder) decodeElement() (id identity.NumericIdentity, ls labels.Labels, bad, err error) {
	if d.scan.Peek() != '{' {
		if err := d.scan.SkipValue(0); err != nil {
			return 0, nil, nil, err
		}
		return 0, nil, ErrNotObject, nil
	}
	d.scan.Advance()
	// A repeated field replaces the earlier one, as in encoding/json, so
	// each field keeps its own verdict.
	haveID, haveLabels := false, false
	var idErr, labelsErr error
	err = d.scan.EachField(func(name []byte) error {
		switch {
		case jsonscan.EqualFold(name, "id"):
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
		case jsonscan.EqualFold(name, "labels"):
			haveLabels = true
			var err error
			ls, labelsErr, err = d.labelMap()
			return err
		default:
			return d.scan.SkipValue(1)
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

// labelMap parses the "labels" value. lerr reports labels that are
// well-formed JSON but not valid labels.
func (d *decoder) labelMap() (ls labels.Labels, lerr, err error) {
	switch d.scan.Peek() {
	case '{':
	case 'n':
		if d.scan.Literal("null") {
			return nil, nil, nil
		}
		return nil, nil, d.scan.Fail("invalid literal")
	default:
		if err := d.scan.SkipValue(1); err != nil {
			return nil, nil, err
		}
		return nil, fmt.Errorf("%w: not an object", ErrBadLabels), nil
	}
	d.scan.Advance()
	d.labels = d.labels[:0]
	err = d.scan.EachField(func(name []byte) error {
		mapKey := intern(name)
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
	switch d.scan.Peek() {
	case '"':
		s, err := d.scan.ReadString()
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
		d.scan.Advance()
	default:
		if err := d.scan.SkipValue(2); err != nil {
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
	err = d.scan.EachField(func(name []byte) error {
		var field int
		switch {
		case jsonscan.EqualFold(name, "key"):
			field, haveKey = fieldKey, true
		case jsonscan.EqualFold(name, "value"):
			field = fieldValue
		case jsonscan.EqualFold(name, "source"):
			field = fieldSource
		default:
			return d.scan.SkipValue(3)
		}
		var s []byte
		switch d.scan.Peek() {
		case '"':
			var err error
			if s, err = d.scan.ReadString(); err != nil {
				return err
			}
		case 'n':
			if !d.scan.Literal("null") {
				return d.scan.Fail("invalid literal")
			}
		default:
			if bad == nil {
				bad = fmt.Errorf("field %q is not a string", name)
			}
			return d.scan.SkipValue(3)
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
			l.Source = intern(s)
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

// interned holds the strings that most labels of a checkpoint repeat: the
// sources, and the keys of reserved labels, which most local identities
// carry. Decoding returns these constants rather than allocating a string
// for each label (a map index with string(b) does not allocate).
var interned = map[string]string{}

func init() {
	for _, s := range []string{
		labels.SourceCIDR, labels.SourceReserved, labels.SourceFQDN, labels.SourceK8s, labels.SourceUnspec,
		labels.IDNameWorld, labels.IDNameWorldIPv4, labels.IDNameWorldIPv6, labels.IDNameRemoteNode,
	} {
		interned[s] = s
	}
}

// intern returns b as a string, the constant of interned when there is one.
func intern(b []byte) string {
	if s, ok := interned[string(b)]; ok {
		return s
	}
	return string(b)
}

// number parses a JSON number. ok is false when it is valid JSON but not
// an integer in the range of uint32.
func (d *decoder) number() (v uint32, ok bool, err error) {
	if !d.scan.AtEnd() && !jsonscan.IsNumberStart(d.scan.Peek()) {
		// Another JSON type: a wrong type, not a syntax error.
		return 0, false, d.scan.SkipValue(1)
	}
	digits, err := d.scan.ReadNumber()
	if err != nil {
		return 0, false, err
	}
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
