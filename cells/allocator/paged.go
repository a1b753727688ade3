package allocator

import (
	"maps"
	"slices"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/idtable"
)

// identityState is the set of identities the dispatcher has delivered. The
// local scopes, where a burst may add a million identities, live in paged
// tables; the rest (reserved, global, remote clusters) in a map.
type identityState struct {
	local, remote idtable.Table[identity.Identity]
	other         map[identity.NumericIdentity]*identity.Identity
}

func newIdentityState() identityState {
	return identityState{other: map[identity.NumericIdentity]*identity.Identity{}}
}

func (s *identityState) pages(id identity.NumericIdentity) *idtable.Table[identity.Identity] {
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
		v := p.Get(id)
		return v, v != nil
	}
	v, ok := s.other[id]
	return v, ok
}

func (s *identityState) set(ident *identity.Identity) {
	if p := s.pages(ident.ID); p != nil {
		p.Set(ident.ID, ident)
		return
	}
	s.other[ident.ID] = ident
}

func (s *identityState) delete(id identity.NumericIdentity) {
	if p := s.pages(id); p != nil {
		p.Set(id, nil)
		return
	}
	delete(s.other, id)
}

func (s *identityState) len() int { return s.local.Len() + s.remote.Len() + len(s.other) }

// each calls fn for every identity in the order of the numeric IDs.
func (s *identityState) each(fn func(*identity.Identity)) {
	// The other scopes' IDs are all below the local scopes'.
	for _, id := range slices.Sorted(maps.Keys(s.other)) {
		fn(s.other[id])
	}
	s.local.Each(fn)
	s.remote.Each(fn)
}
