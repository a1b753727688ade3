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

// LookupReserved returns the reserved identity a label set resolves to
// whatever Cilium's options say, or nil: the rules of a ReservedResolver with
// well-known identities off and --policy-cidr-match-mode=nodes, under which
// no set holding reserved:remote-node (without reserved:host) is reserved.
// Code that knows the agent's options uses a ReservedResolver instead.
func LookupReserved(ls labels.Labels) *Identity {
	return alwaysReserved.LookupByLabels(ls)
}

var alwaysReserved = NewReservedResolver(ReservedConfig{PolicyCIDRMatchesNodes: true})
