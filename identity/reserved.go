package identity

import (
	"github.com/identityd/identityd/labels"
)

// Reserved identities, fixed on every node of every cluster.
const (
	ReservedIdentityHost          NumericIdentity = 1
	ReservedIdentityWorld         NumericIdentity = 2
	ReservedIdentityUnmanaged     NumericIdentity = 3
	ReservedIdentityHealth        NumericIdentity = 4
	ReservedIdentityInit          NumericIdentity = 5
	ReservedIdentityRemoteNode    NumericIdentity = 6
	ReservedIdentityKubeAPIServer NumericIdentity = 7
	ReservedIdentityIngress       NumericIdentity = 8
	ReservedIdentityWorldIPv4     NumericIdentity = 9
	ReservedIdentityWorldIPv6     NumericIdentity = 10
)

type reservedEntry struct {
	name     string
	identity *Identity
}

// reserved is indexed by numeric ID; index 0 is unused.
var reserved = func() []reservedEntry {
	mk := func(id NumericIdentity, name string, extra ...labels.Label) reservedEntry {
		ls := append([]labels.Label{labels.Reserved(name)}, extra...)
		return reservedEntry{name: name, identity: &Identity{ID: id, Labels: labels.MustNew(ls...)}}
	}
	return []reservedEntry{
		{},
		mk(ReservedIdentityHost, labels.IDNameHost),
		mk(ReservedIdentityWorld, labels.IDNameWorld),
		mk(ReservedIdentityUnmanaged, labels.IDNameUnmanaged),
		mk(ReservedIdentityHealth, labels.IDNameHealth),
		mk(ReservedIdentityInit, labels.IDNameInit),
		mk(ReservedIdentityRemoteNode, labels.IDNameRemoteNode),
		mk(ReservedIdentityKubeAPIServer, labels.IDNameKubeAPIServer, labels.LabelRemoteNode),
		mk(ReservedIdentityIngress, labels.IDNameIngress),
		mk(ReservedIdentityWorldIPv4, labels.IDNameWorldIPv4),
		mk(ReservedIdentityWorldIPv6, labels.IDNameWorldIPv6),
	}
}()

// ReservedIdentities returns the reserved identities 1..10 in ID order. The
// returned identities are shared and must not be modified.
func ReservedIdentities() []*Identity {
	out := make([]*Identity, 0, len(reserved)-1)
	for _, e := range reserved[1:] {
		out = append(out, e.identity)
	}
	return out
}

// ReservedName returns the name of a reserved identity ("host", "world", …).
func ReservedName(id NumericIdentity) (string, bool) {
	if id == InvalidIdentity || int(id) >= len(reserved) {
		return "", false
	}
	return reserved[id].name, true
}

// LookupReservedByID returns the reserved identity with this number, or nil.
func LookupReservedByID(id NumericIdentity) *Identity {
	if id == InvalidIdentity || int(id) >= len(reserved) {
		return nil
	}
	return reserved[id].identity
}

// LookupReservedByName returns the reserved identity with this name, or nil.
func LookupReservedByName(name string) *Identity {
	for _, e := range reserved[1:] {
		if e.name == name {
			return e.identity
		}
	}
	return nil
}

// LookupReserved returns the reserved identity a label set resolves to, or
// nil if it is not a reserved set. A set with reserved:host is the host
// whatever else it holds; reserved:kube-apiserver with reserved:remote-node
// is the kube-apiserver; otherwise only a single reserved label resolves, so
// that workloads cannot claim a reserved identity by adding a reserved label
// to their own.
func LookupReserved(ls labels.Labels) *Identity {
	if ls.Has(labels.LabelHost) {
		return reserved[ReservedIdentityHost].identity
	}
	switch len(ls) {
	case 1:
		if ls[0].Source != labels.SourceReserved || ls[0].Value != "" {
			return nil
		}
		if id := LookupReservedByName(ls[0].Key); id != nil && len(id.Labels) == 1 {
			return id
		}
	case 2:
		if kas := reserved[ReservedIdentityKubeAPIServer].identity; ls.Equal(kas.Labels) {
			return kas
		}
	}
	return nil
}
