package checkpoint

import (
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// AppendJSON appends the checkpoint encoding of ids to b and returns the
// extended buffer. Only identities with a local scope are written: global
// ones live in the kvstore and would be refused on load. The output is
// deterministic — identities sorted by numeric ID, labels by key — so that
// two encodings of the same state are byte-identical and a rewrite of an
// unchanged state can be recognised. It is a compact JSON array followed by
// one newline; an empty state is "[]\n".
//
// The encoder is hand-written because it runs on every coalesced change
// with up to hundreds of thousands of identities: appending into one
// buffer costs a fraction of reflection-based marshalling.
func AppendJSON(b []byte, ids []*identity.Identity) []byte {
	order := sortedOrder(ids)
	b = slices.Grow(b, estimateSize(ids))
	b = append(b, '[')
	first := true
	for _, k := range order {
		id := ids[uint32(k)]
		if !first {
			b = append(b, ',')
		}
		first = false
		b = appendIdentity(b, id)
	}
	b = append(b, ']', '\n')
	return b
}

// sortedOrder returns the indexes of the local identities of ids in
// ascending ID order, each packed as ID<<32|index. Sorting plain integers
// is several times faster than sorting the pointers with a comparison
// function, and the packing keeps the sort stable for duplicate IDs.
func sortedOrder(ids []*identity.Identity) []uint64 {
	order := make([]uint64, 0, len(ids))
	sorted := true
	var prev uint64
	for i, id := range ids {
		if id == nil || !id.ID.HasLocalScope() {
			continue
		}
		k := uint64(id.ID)<<32 | uint64(i)
		if k < prev {
			sorted = false
		}
		prev = k
		order = append(order, k)
	}
	if !sorted {
		slices.Sort(order)
	}
	return order
}

// estimateSize returns the size of the encoding of ids, so that the buffer
// is grown once.
func estimateSize(ids []*identity.Identity) int {
	n := 3
	for _, id := range ids {
		if id == nil {
			continue
		}
		n += len(`{"id":4294967295,"labels":{}},`)
		for _, l := range id.Labels {
			n += 2*len(l.Key) + len(l.Value) + len(l.Source) + len(`"":{"key":"","value":"","source":""},`)
		}
	}
	return n
}

func appendIdentity(b []byte, id *identity.Identity) []byte {
	b = append(b, `{"id":`...)
	b = strconv.AppendUint(b, uint64(id.ID), 10)
	b = append(b, `,"labels":{`...)
	ls := id.Labels
	if !slices.IsSortedFunc(ls, compareKeys) {
		// Labels built through labels.New are sorted; a hand-built
		// slice may not be, and the output must still be
		// deterministic.
		ls = slices.SortedFunc(slices.Values(ls), compareKeys)
	}
	for i, l := range ls {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendString(b, l.Key)
		b = append(b, `:{"key":`...)
		b = appendString(b, l.Key)
		if l.Value != "" {
			b = append(b, `,"value":`...)
			b = appendString(b, l.Value)
		}
		b = append(b, `,"source":`...)
		b = appendString(b, l.Source)
		b = append(b, '}')
	}
	b = append(b, '}', '}')
	return b
}

func compareKeys(a, b labels.Label) int { return strings.Compare(a.Key, b.Key) }

const hexDigits = "0123456789abcdef"

// appendString appends s as a JSON string. Valid label sets contain no
// control characters, so the fast path copies the string as is; the slow
// path keeps the output valid JSON for anything else.
func appendString(b []byte, s string) []byte {
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' && c < utf8.RuneSelf {
			i++
			continue
		}
		if c >= utf8.RuneSelf {
			r, size := utf8.DecodeRuneInString(s[i:])
			if r == utf8.RuneError && size == 1 {
				// Invalid UTF-8 becomes U+FFFD, as a JSON
				// reader would do anyway.
				b = append(b, s[start:i]...)
				b = append(b, `\ufffd`...)
				i += size
				start = i
				continue
			}
			i += size
			continue
		}
		b = append(b, s[start:i]...)
		switch c {
		case '"', '\\':
			b = append(b, '\\', c)
		case '\n':
			b = append(b, '\\', 'n')
		case '\r':
			b = append(b, '\\', 'r')
		case '\t':
			b = append(b, '\\', 't')
		default:
			b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
		}
		i++
		start = i
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}
