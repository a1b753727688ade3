// Package labels is the label model of identityd: a label is a
// {source, key, value} triple, a label set is a list of labels with unique
// keys kept sorted by key, and the canonical string of a set is the key under
// which it is stored in etcd and in the local allocators.
//
// The text and canonical forms are those of Cilium (see docs/formats.md), so
// that identityd and Cilium agents can share an etcd and a checkpoint file.
// Neither form has an escape mechanism, so every constructor validates its
// input and refuses labels that could not survive a round trip.
package labels

import (
	"cmp"
	"slices"
	"strings"
	"unsafe"
)

// Label sources known to identityd. A source is free text; these are the ones
// with a meaning to the allocator (scope rules, reserved lookup).
const (
	SourceUnspec    = "unspec"
	SourceAny       = "any"
	SourceK8s       = "k8s"
	SourceContainer = "container"
	SourceCNI       = "cni"
	SourceReserved  = "reserved"
	SourceCIDR      = "cidr"
	SourceNode      = "node"
	SourceFQDN      = "fqdn"
	SourceDirectory = "directory"
)

// Limits on a label set, checked before a set can become an etcd key.
const (
	// MaxLabels is the largest number of labels in one set.
	MaxLabels = 256
	// MaxCanonicalBytes is the largest canonical string of one set. etcd
	// accepts larger keys, but every reference key repeats the string and
	// every watcher receives it; 16 KiB leaves room for the largest
	// Kubernetes label sets seen in practice.
	MaxCanonicalBytes = 16 << 10
)

// Label is one label. The zero Source is normalized to SourceUnspec by the
// constructors.
type Label struct {
	Key    string `json:"key"`
	Value  string `json:"value,omitempty"`
	Source string `json:"source"`
}

// NewLabel returns a validated label. An empty source becomes SourceUnspec.
func NewLabel(source, key, value string) (Label, error) {
	if source == "" {
		source = SourceUnspec
	}
	l := Label{Key: key, Value: value, Source: source}
	return l, l.Validate()
}

// String returns the text form `source:key=value`, or `source:key` when the
// value is empty. Parse reads it back.
func (l Label) String() string {
	if l.Value == "" {
		return l.Source + ":" + l.Key
	}
	return l.Source + ":" + l.Key + "=" + l.Value
}

// Labels is a label set: labels with unique keys, sorted by key in byte
// order. Build one with New, Parse or ParseCanonical; a Labels value is never
// modified after construction, so it may be shared freely.
type Labels []Label

// Empty is the label set without labels.
var Empty = Labels{}

// New builds a validated label set from labels in any order. Two labels with
// the same key are an error, as is any label that cannot round-trip through
// the canonical string.
func New(ls ...Label) (Labels, error) {
	out := make(Labels, len(ls))
	copy(out, ls)
	for i := range out {
		if out[i].Source == "" {
			out[i].Source = SourceUnspec
		}
	}
	slices.SortFunc(out, func(a, b Label) int { return strings.Compare(a.Key, b.Key) })
	return out, out.Validate()
}

// MustNew is New for label sets written in code; it panics on an invalid set.
func MustNew(ls ...Label) Labels {
	out, err := New(ls...)
	if err != nil {
		panic(err)
	}
	return out
}

// Validate checks that the set is sorted by unique keys, that every label can
// round-trip through the canonical string and that the set is within the
// limits. The error is an *InvalidLabelError or a *LimitError.
func (ls Labels) Validate() error {
	if len(ls) > MaxLabels {
		return &LimitError{What: "labels", Limit: MaxLabels, Got: len(ls)}
	}
	size := 0
	for i, l := range ls {
		if err := l.Validate(); err != nil {
			return err
		}
		if i > 0 {
			switch c := strings.Compare(ls[i-1].Key, l.Key); {
			case c == 0:
				return &InvalidLabelError{Label: l.String(), Reason: ErrDuplicateKey}
			case c > 0:
				return &InvalidLabelError{Label: l.String(), Reason: ErrUnsorted}
			}
		}
		size += len(l.Source) + len(l.Key) + len(l.Value) + 3
	}
	if size > MaxCanonicalBytes {
		return &LimitError{What: "bytes of canonical string", Limit: MaxCanonicalBytes, Got: size}
	}
	return nil
}

// Len returns the number of labels.
func (ls Labels) Len() int { return len(ls) }

// Get returns the label with the given key.
func (ls Labels) Get(key string) (Label, bool) {
	// Most sets are small (a CIDR set has two labels): a scan with ==,
	// which compares lengths first, beats a binary search there.
	if len(ls) <= 8 {
		for _, l := range ls {
			if l.Key == key {
				return l, true
			}
		}
		return Label{}, false
	}
	i, ok := slices.BinarySearchFunc(ls, key, func(l Label, k string) int { return strings.Compare(l.Key, k) })
	if !ok {
		return Label{}, false
	}
	return ls[i], true
}

// Has reports whether the set holds exactly this label (key, value and source).
func (ls Labels) Has(l Label) bool {
	got, ok := ls.Get(l.Key)
	return ok && got == l
}

// Equal reports whether two sets hold the same labels.
func (ls Labels) Equal(other Labels) bool { return slices.Equal(ls, other) }

// Compare orders label sets by their canonical strings without building them.
func (ls Labels) Compare(other Labels) int {
	for i := range min(len(ls), len(other)) {
		a, b := ls[i], other[i]
		if c := cmp.Or(strings.Compare(a.Key, b.Key), strings.Compare(a.Source, b.Source), strings.Compare(a.Value, b.Value)); c != 0 {
			return c
		}
	}
	return cmp.Compare(len(ls), len(other))
}

// OnlySources reports whether every label's source is one of the given
// sources. It is false for the empty set.
func (ls Labels) OnlySources(sources ...string) bool {
	if len(ls) == 0 {
		return false
	}
	for _, l := range ls {
		if !slices.Contains(sources, l.Source) {
			return false
		}
	}
	return true
}

// Merge returns the union of the sets; where two sets have a label with the
// same key, the later set's label wins.
func Merge(sets ...Labels) Labels {
	n := 0
	for _, s := range sets {
		n += len(s)
	}
	out := make(Labels, 0, n)
	for _, s := range sets {
		out = append(out, s...)
	}
	// A stable sort keeps later sets after earlier ones for equal keys, so
	// keeping the last of each run lets the later set win.
	slices.SortStableFunc(out, func(a, b Label) int { return strings.Compare(a.Key, b.Key) })
	res := out[:0]
	for i, l := range out {
		if i+1 < len(out) && out[i+1].Key == l.Key {
			continue
		}
		res = append(res, l)
	}
	return slices.Clip(res)
}

// String returns the printable form: the labels' text forms joined by ",".
// ParseList reads it back.
func (ls Labels) String() string {
	var b strings.Builder
	for i, l := range ls {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(l.String())
	}
	return b.String()
}

// Strings returns the labels' text forms.
func (ls Labels) Strings() []string {
	out := make([]string, len(ls))
	for i, l := range ls {
		out[i] = l.String()
	}
	return out
}

// Canonical returns the canonical (kvstore) string: every label as
// `source:key=value;`, in key order. It is the etcd label key and the local
// allocators' lookup key.
func (ls Labels) Canonical() string {
	b := ls.CanonicalBytes()
	if len(b) == 0 {
		return ""
	}
	// b is new and never written again: the string may share it, which
	// saves a copy on every etcd key and table index key built from it.
	return unsafe.String(&b[0], len(b))
}

// CanonicalBytes returns the canonical string as a new byte slice, for
// index keys that are byte slices.
func (ls Labels) CanonicalBytes() []byte {
	return ls.AppendCanonical(make([]byte, 0, ls.canonicalLen()))
}

// AppendCanonical appends the canonical string to b, for callers that want
// to look a set up without allocating.
func (ls Labels) AppendCanonical(b []byte) []byte {
	for _, l := range ls {
		b = append(b, l.Source...)
		b = append(b, ':')
		b = append(b, l.Key...)
		b = append(b, '=')
		b = append(b, l.Value...)
		b = append(b, ';')
	}
	return b
}

func (ls Labels) canonicalLen() int {
	n := 0
	for _, l := range ls {
		n += len(l.Source) + len(l.Key) + len(l.Value) + 3
	}
	return n
}
