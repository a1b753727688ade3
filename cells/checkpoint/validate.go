package checkpoint

import (
	"fmt"
	"hash/maphash"
	"math/bits"
	"slices"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

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
