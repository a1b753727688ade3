package labels

import (
	"net/netip"
	"strconv"
	"strings"
)

// Reserved label keys (source SourceReserved, empty value) with a meaning to
// the allocator.
const (
	IDNameHost          = "host"
	IDNameWorld         = "world"
	IDNameUnmanaged     = "unmanaged"
	IDNameHealth        = "health"
	IDNameInit          = "init"
	IDNameRemoteNode    = "remote-node"
	IDNameKubeAPIServer = "kube-apiserver"
	IDNameIngress       = "ingress"
	IDNameWorldIPv4     = "world-ipv4"
	IDNameWorldIPv6     = "world-ipv6"
)

// Reserved returns the reserved label with the given name.
func Reserved(name string) Label {
	return Label{Source: SourceReserved, Key: name}
}

// Frequently used reserved labels.
var (
	LabelWorld      = Reserved(IDNameWorld)
	LabelWorldIPv4  = Reserved(IDNameWorldIPv4)
	LabelWorldIPv6  = Reserved(IDNameWorldIPv6)
	LabelRemoteNode = Reserved(IDNameRemoteNode)
	LabelHost       = Reserved(IDNameHost)
)

// CIDRKey returns the key of the cidr label for a prefix: the masked prefix
// in text form, with every ':' of an IPv6 address written as '-' and a
// leading or trailing ':' padded with '0' so that the key never starts or
// ends with '-' (`2001:db8::/32` → `2001-db8--0/32`, `::1/128` → `0--1/128`).
func CIDRKey(p netip.Prefix) string {
	p = p.Masked()
	if p.Addr().Is4() {
		return p.String()
	}
	addr := p.Addr().String()
	var b strings.Builder
	b.Grow(len(addr) + 6)
	if strings.HasPrefix(addr, ":") {
		b.WriteByte('0')
	}
	b.WriteString(strings.ReplaceAll(addr, ":", "-"))
	if strings.HasSuffix(addr, ":") {
		b.WriteByte('0')
	}
	b.WriteByte('/')
	b.WriteString(strconv.Itoa(p.Bits()))
	return b.String()
}

// WorldLabel returns the world label for a prefix's family: `reserved:world`,
// or in dual-stack mode `reserved:world-ipv4` / `reserved:world-ipv6`.
func WorldLabel(p netip.Prefix, dualStack bool) Label {
	switch {
	case !dualStack:
		return LabelWorld
	case p.Addr().Is4():
		return LabelWorldIPv4
	default:
		return LabelWorldIPv6
	}
}

// FromPrefix returns the labels of a CIDR identity: one cidr label for the
// masked prefix plus the world label. A /0 prefix gets only the world label.
func FromPrefix(p netip.Prefix, dualStack bool) Labels {
	world := WorldLabel(p, dualStack)
	if p.Bits() == 0 {
		return Labels{world}
	}
	// cidr keys start with a digit and every world key starts with 'w',
	// so this order is already sorted.
	return Labels{{Source: SourceCIDR, Key: CIDRKey(p)}, world}
}
