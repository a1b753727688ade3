package checkpoint

import (
	"fmt"
	"net/netip"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// cidrIdentities returns n node-local CIDR identities with consecutive IDs.
func cidrIdentities(n int) []*identity.Identity {
	out := make([]*identity.Identity, n)
	for i := range n {
		addr := netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})
		out[i] = &identity.Identity{
			ID:     identity.NumericIdentity(identity.ScopeLocal) + identity.NumericIdentity(i+1),
			Labels: labels.FromPrefix(netip.PrefixFrom(addr, 32), false),
		}
	}
	return out
}

func mustPrefix(s string) netip.Prefix { return netip.MustParsePrefix(s) }

func values(ids []*identity.Identity) []identity.Identity {
	out := make([]identity.Identity, len(ids))
	for i, id := range ids {
		out[i] = *id
	}
	return out
}

func describe(ids []identity.Identity) string {
	s := ""
	for _, id := range ids {
		s += fmt.Sprintf("%d %s\n", id.ID, id.Labels)
	}
	return s
}
