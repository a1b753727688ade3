// Package identity is the numeric-identity model of identityd: the uint32
// numbers that stand for label sets, their scopes, the reserved identities and
// the cluster-ID arithmetic that splits the global ID space between clusters.
//
// Every number here is shared with Cilium (see docs/formats.md); an agent that
// composes identityd's cells names these types in its own code.
package identity

import (
	"errors"
	"fmt"
	"strconv"

	"github.com/identityd/identityd/labels"
)

// NumericIdentity is a security identity as it appears in datapath maps and
// policy. Its top byte is the scope.
type NumericIdentity uint32

// Scope is the top byte of a numeric identity (mask ScopeMask).
type Scope uint32

const (
	// ScopeMask selects the scope byte of a numeric identity.
	ScopeMask NumericIdentity = 0xFF000000
	// ScopeGlobal holds reserved identities and cluster-wide identities
	// shared through etcd.
	ScopeGlobal Scope = 0x00000000
	// ScopeLocal holds node-local identities (CIDR-, FQDN-like label sets).
	ScopeLocal Scope = 0x01000000
	// ScopeRemoteNode holds node-local identities of remote nodes' IPs.
	ScopeRemoteNode Scope = 0x02000000
)

// Numeric identity constants.
const (
	// InvalidIdentity is the unknown identity.
	InvalidIdentity NumericIdentity = 0
	// MinUserReservedIdentity and MaxUserReservedIdentity bound the IDs
	// operators may map to fixed label sets.
	MinUserReservedIdentity NumericIdentity = 128
	MaxUserReservedIdentity NumericIdentity = 255
	// MinAllocatorIdentity is the first identity the global allocator hands
	// out in cluster 0.
	MinAllocatorIdentity NumericIdentity = 256
	// MinLocalIdentity and MaxLocalIdentity bound the per-scope counter of
	// the local allocators; the scope is OR-ed in.
	MinLocalIdentity NumericIdentity = 1
	MaxLocalIdentity NumericIdentity = 0xFFFFFF
)

// Scope returns the identity's scope.
func (id NumericIdentity) Scope() Scope { return Scope(id & ScopeMask) }

// IsReserved reports whether id is in the reserved range 1..255.
func (id NumericIdentity) IsReserved() bool {
	return id > InvalidIdentity && id < MinAllocatorIdentity
}

// HasLocalScope reports whether id was allocated by a node-local allocator
// (node-local or remote-node scope).
func (id NumericIdentity) HasLocalScope() bool {
	s := id.Scope()
	return s == ScopeLocal || s == ScopeRemoteNode
}

// String returns the decimal form.
func (id NumericIdentity) String() string { return strconv.FormatUint(uint64(id), 10) }

// ParseNumericIdentity reads a decimal numeric identity.
func ParseNumericIdentity(s string) (NumericIdentity, error) {
	n, err := strconv.ParseUint(s, 10, 32)
	if err != nil {
		return InvalidIdentity, fmt.Errorf("invalid numeric identity %q: %w", s, err)
	}
	return NumericIdentity(n), nil
}

// ErrInvalidNumericIdentity is wrapped by NumericIdentity.Validate.
var ErrInvalidNumericIdentity = errors.New("invalid numeric identity")

// Validate checks that id can stand for a label set: not 0, and in the
// global range (1 .. 0xFFFFFF, reserved and every cluster's range) or in a
// local scope with a non-zero counter (0x01000001 .. 0x01FFFFFF and
// 0x02000001 .. 0x02FFFFFF). Anything else is no identity any allocator
// hands out, and a datapath map must not get it.
func (id NumericIdentity) Validate() error {
	switch counter := id &^ ScopeMask; {
	case id == InvalidIdentity:
		return fmt.Errorf("%w: 0 is the unknown identity", ErrInvalidNumericIdentity)
	case id.Scope() == ScopeGlobal:
		return nil
	case !id.Scope().IsLocal():
		return fmt.Errorf("%w: %d has scope byte %#02x (want 0x00 global, 0x01 local or 0x02 remote-node)", ErrInvalidNumericIdentity, uint32(id), uint32(id)>>24)
	case counter == 0:
		return fmt.Errorf("%w: %d is the base of the %s scope, not an identity", ErrInvalidNumericIdentity, uint32(id), id.Scope())
	}
	return nil
}

// String returns "global", "local" or "remote-node".
func (s Scope) String() string {
	switch s {
	case ScopeGlobal:
		return "global"
	case ScopeLocal:
		return "local"
	case ScopeRemoteNode:
		return "remote-node"
	}
	return fmt.Sprintf("scope(%#x)", uint32(s))
}

// IsLocal reports whether identities of this scope are allocated node-locally.
func (s Scope) IsLocal() bool { return s == ScopeLocal || s == ScopeRemoteNode }

// Identity is a numeric identity with the label set it stands for.
type Identity struct {
	ID     NumericIdentity `json:"id"`
	Labels labels.Labels   `json:"labels"`
}

func (i *Identity) String() string {
	return i.ID.String() + " " + i.Labels.String()
}

// ScopeForLabels returns the scope an identity for the label set gets:
// remote-node scope if it holds reserved:remote-node; local scope if every
// label comes from cidr, fqdn or reserved; global otherwise (also for the
// empty set). Reserved label sets are resolved by LookupReserved first.
func ScopeForLabels(ls labels.Labels) Scope {
	if ls.Has(labels.LabelRemoteNode) {
		return ScopeRemoteNode
	}
	if ls.OnlySources(labels.SourceCIDR, labels.SourceFQDN, labels.SourceReserved) {
		return ScopeLocal
	}
	return ScopeGlobal
}
