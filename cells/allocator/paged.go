package allocator

import (
	"maps"
	"slices"

	"github.com/identityd/identityd/identity"
)

// pagedTable maps the 24-bit counter of a local identity to a value with
// two array lookups: local IDs are dense and mostly sequential, so pages of
// 64Ki pointers cost 8 bytes per identity and no hashing, against ~30 for a
// map, and a lookup touches one cache line instead of a map's two.
type pagedTable[T any] struct {
	pages [256]*[1 << 16]*T
	n     int
}

func (t *pagedTable[T]) get(id identity.NumericIdentity) *T {
	c := uint32(id &^ identity.ScopeMask)
	p := t.pages[c>>16]
	if p == nil {
		return nil
	}
	return p[c&0xFFFF]
}

// set stores v under id; nil removes it.
func (t *pagedTable[T]) set(id identity.NumericIdentity, v *T) {
	c := uint32(id &^ identity.ScopeMask)
	p := t.pages[c>>16]
	if p == nil {
		if v == nil {
			return
		}
		p = new([1 << 16]*T)
		t.pages[c>>16] = p
	}
	switch old := p[c&0xFFFF]; {
	case old == nil && v != nil:
		t.n++
	case old != nil && v == nil:
		t.n--
	}
	p[c&0xFFFF] = v
}

// each calls fn for every value in the order of the counters.
func (t *pagedTable[T]) each(fn func(*T)) {
	for _, p := range t.pages {
		if p == nil {
			continue
		}
		for _, v := range p {
			if v != nil {
				fn(v)
			}
		}
	}
}

// identityState is the set of identities the dispatcher has delivered. The
// local scopes, where a burst may add a million identities, live in paged
// tables; the rest (reserved, global, remote clusters) in a map.
type identityState struct {
	local, remote pagedTable[identity.Identity]
	other         map[identity.NumericIdentity]*identity.Identity
}

func newIdentityState() identityState {
	return identityState{other: map[identity.NumericIdentity]*identity.Identity{}}
}

func (s *identityState) pages(id identity.NumericIdentity) *pagedTable[identity.Identity] {
	switch id.Scope() {
	case identity.ScopeLocal:
		return &s.local
	case identity.ScopeRemoteNode:
		return &s.remote
	}
	return nil
}

func (s *identityState) get(id identity.NumericIdentity) (*identity.Identity, bool) {
	if p := s.pages(id); p != nil {
		v := p.get(id)
		return v, v != nil
	}
	v, ok := s.other[id]
	return v, ok
}

func (s *identityState) set(ident *identity.Identity) {
	if p := s.pages(ident.ID); p != nil {
		p.set(ident.ID, ident)
		return
	}
	s.other[ident.ID] = ident
}

func (s *identityState) delete(id identity.NumericIdentity) {
	if p := s.pages(id); p != nil {
		p.set(id, nil)
		return
	}
	delete(s.other, id)
}

func (s *identityState) len() int { return s.local.n + s.remote.n + len(s.other) }

// each calls fn for every identity in the order of the numeric IDs.
func (s *identityState) each(fn func(*identity.Identity)) {
	// The other scopes' IDs are all below the local scopes'.
	for _, id := range slices.Sorted(maps.Keys(s.other)) {
		fn(s.other[id])
	}
	s.local.each(fn)
	s.remote.each(fn)
}
