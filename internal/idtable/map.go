package idtable

import (
	"maps"
	"slices"

	"github.com/identityd/identityd/identity"
)

// Map maps numeric identities of every scope to values. The local scopes,
// where a burst may add a million identities, live in Tables; the rest
// (reserved, global, remote clusters) in a Go map. The zero Map is empty
// and ready to use.
type Map[T any] struct {
	local, remote Table[T]
	other         map[identity.NumericIdentity]*T
}

func (m *Map[T]) table(id identity.NumericIdentity) *Table[T] {
	switch id.Scope() {
	case identity.ScopeLocal:
		return &m.local
	case identity.ScopeRemoteNode:
		return &m.remote
	}
	return nil
}

// Get returns the value of id, or nil.
func (m *Map[T]) Get(id identity.NumericIdentity) *T {
	if t := m.table(id); t != nil {
		return t.Get(id)
	}
	return m.other[id]
}

// Set stores v under id; nil removes it.
func (m *Map[T]) Set(id identity.NumericIdentity, v *T) {
	if t := m.table(id); t != nil {
		t.Set(id, v)
		return
	}
	if v == nil {
		delete(m.other, id)
		return
	}
	if m.other == nil {
		m.other = map[identity.NumericIdentity]*T{}
	}
	m.other[id] = v
}

// Len returns the number of values.
func (m *Map[T]) Len() int { return m.local.Len() + m.remote.Len() + len(m.other) }

// Each calls fn for every value in the order of the numeric IDs.
func (m *Map[T]) Each(fn func(*T)) {
	// The other scopes' IDs are all below the local scopes'.
	for _, id := range slices.Sorted(maps.Keys(m.other)) {
		fn(m.other[id])
	}
	m.local.Each(fn)
	m.remote.Each(fn)
}

// Nodes returns the number of middle nodes and leaves of both local
// scopes' Tables, as Table.Nodes does.
func (m *Map[T]) Nodes() (mids, leaves int) {
	lm, ll := m.local.Nodes()
	rm, rl := m.remote.Nodes()
	return lm + rm, ll + rl
}
