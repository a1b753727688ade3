package ipcachemap

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"

	"github.com/identityd/identityd/identity"
)

// Sizes of the binary key and value (FORMATS.md §5, Cilium v1.16 layout).
const (
	KeySize   = 24
	ValueSize = 12
)

// Address families as stored in the key's family byte.
const (
	FamilyIPv4 uint8 = 1
	FamilyIPv6 uint8 = 2
)

// FlagSkipTunnel is bit 0 of Value.Flags: traffic to the prefix is not
// encapsulated even when a tunnel endpoint is set.
const FlagSkipTunnel uint8 = 1 << 0

// keyStaticBits is the part of the key data that every lookup must match
// exactly: cluster_id (16) + pad (8) + family (8). prefixlen counts them so
// that the trie never mixes clusters or families.
const keyStaticBits = 32

// ErrInvalidKey and ErrInvalidValue are wrapped by the errors of
// marshalling and unmarshalling keys and values.
var (
	ErrInvalidKey   = errors.New("invalid ipcache map key")
	ErrInvalidValue = errors.New("invalid ipcache map value")
)

// Key selects an ipcache entry: an IP prefix within a cluster.
type Key struct {
	// Prefix is an IPv4 or IPv6 prefix. Host bits are ignored (the stored
	// key is masked). IPv4-mapped IPv6 prefixes are rejected: the datapath
	// looks IPv4 packets up with family IPv4, so such an entry would never
	// match.
	Prefix netip.Prefix
	// ClusterID is the cluster mesh ID of the prefix's owner; 0 is the local
	// cluster.
	ClusterID uint16
}

// Value is what the datapath learns about a prefix.
type Value struct {
	// Identity is the security identity of the prefix.
	Identity identity.NumericIdentity
	// TunnelEndpoint is the IPv4 address of the node to tunnel to, or the
	// zero Addr for none. The v1.16 layout has room for IPv4 only; 0.0.0.0
	// reads back as the zero Addr.
	TunnelEndpoint netip.Addr
	// EncryptKey is the IPsec key index, 0 for none.
	EncryptKey uint8
	// Flags holds FlagSkipTunnel and future flag bits.
	Flags uint8
}

// Entry is a key with its value.
type Entry struct {
	Key   Key
	Value Value
}

// rawKey and rawValue are the exact bytes the kernel stores. Keeping the
// file backend's table and the batch buffers in this form makes them compact
// and lets syscalls use them without another copy.
type (
	rawKey   [KeySize]byte
	rawValue [ValueSize]byte
)

// String returns "prefix" or "prefix@cluster" for non-zero cluster IDs.
func (k Key) String() string {
	if k.ClusterID == 0 {
		return k.Prefix.String()
	}
	return fmt.Sprintf("%s@%d", k.Prefix, k.ClusterID)
}

func (k Key) put(dst *rawKey) error {
	if !k.Prefix.IsValid() {
		return fmt.Errorf("%w: prefix %v is not valid", ErrInvalidKey, k.Prefix)
	}
	addr := k.Prefix.Addr()
	if addr.Is4In6() {
		return fmt.Errorf("%w: prefix %s is IPv4-mapped IPv6; unmap it first", ErrInvalidKey, k.Prefix)
	}
	masked := k.Prefix.Masked()
	*dst = rawKey{}
	binary.NativeEndian.PutUint32(dst[0:4], uint32(keyStaticBits+masked.Bits()))
	binary.NativeEndian.PutUint16(dst[4:6], k.ClusterID)
	// dst[6] is padding, left zero.
	if addr.Is4() {
		dst[7] = FamilyIPv4
		a4 := masked.Addr().As4()
		copy(dst[8:12], a4[:])
	} else {
		dst[7] = FamilyIPv6
		a16 := masked.Addr().As16()
		copy(dst[8:24], a16[:])
	}
	return nil
}

func (k *Key) get(src *rawKey) error {
	plen := binary.NativeEndian.Uint32(src[0:4])
	if src[6] != 0 {
		return fmt.Errorf("%w: non-zero padding byte %#x", ErrInvalidKey, src[6])
	}
	var (
		addr netip.Addr
		max  uint32
	)
	switch src[7] {
	case FamilyIPv4:
		addr = netip.AddrFrom4([4]byte(src[8:12]))
		max = 32
	case FamilyIPv6:
		addr = netip.AddrFrom16([16]byte(src[8:24]))
		max = 128
	default:
		return fmt.Errorf("%w: unknown address family %d", ErrInvalidKey, src[7])
	}
	if plen < keyStaticBits || plen > keyStaticBits+max {
		return fmt.Errorf("%w: prefix length field %d out of range %d..%d", ErrInvalidKey, plen, keyStaticBits, keyStaticBits+max)
	}
	// Bits past the prefix length take no part in the kernel's matching, so
	// they are dropped rather than rejected.
	pfx, err := addr.Prefix(int(plen - keyStaticBits))
	if err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidKey, err)
	}
	k.Prefix = pfx
	k.ClusterID = binary.NativeEndian.Uint16(src[4:6])
	return nil
}

// AppendBinary appends the 24-byte key layout to b.
func (k Key) AppendBinary(b []byte) ([]byte, error) {
	var r rawKey
	if err := k.put(&r); err != nil {
		return b, err
	}
	return append(b, r[:]...), nil
}

// MarshalBinary returns the 24-byte key layout: prefixlen u32 (32 + prefix
// bits), cluster_id u16, pad u8, family u8, 16 address bytes; integers in
// host byte order, the address in network order.
func (k Key) MarshalBinary() ([]byte, error) {
	return k.AppendBinary(make([]byte, 0, KeySize))
}

// UnmarshalBinary decodes the 24-byte key layout. Address bits beyond the
// prefix length are cleared.
func (k *Key) UnmarshalBinary(data []byte) error {
	if len(data) != KeySize {
		return fmt.Errorf("%w: %d bytes, want %d", ErrInvalidKey, len(data), KeySize)
	}
	return k.get((*rawKey)(data))
}

func (v Value) put(dst *rawValue) error {
	*dst = rawValue{}
	binary.NativeEndian.PutUint32(dst[0:4], uint32(v.Identity))
	if v.TunnelEndpoint.IsValid() {
		if !v.TunnelEndpoint.Is4() {
			return fmt.Errorf("%w: tunnel endpoint %s is not IPv4", ErrInvalidValue, v.TunnelEndpoint)
		}
		a4 := v.TunnelEndpoint.As4()
		copy(dst[4:8], a4[:])
	}
	// dst[8:10] is padding, left zero.
	dst[10] = v.EncryptKey
	dst[11] = v.Flags
	return nil
}

func (v *Value) get(src *rawValue) {
	v.Identity = identity.NumericIdentity(binary.NativeEndian.Uint32(src[0:4]))
	v.TunnelEndpoint = netip.Addr{}
	if a4 := [4]byte(src[4:8]); a4 != [4]byte{} {
		v.TunnelEndpoint = netip.AddrFrom4(a4)
	}
	v.EncryptKey = src[10]
	v.Flags = src[11]
}

// AppendBinary appends the 12-byte value layout to b.
func (v Value) AppendBinary(b []byte) ([]byte, error) {
	var r rawValue
	if err := v.put(&r); err != nil {
		return b, err
	}
	return append(b, r[:]...), nil
}

// MarshalBinary returns the 12-byte value layout: sec_identity u32 (host
// order), tunnel endpoint IPv4 (network order), pad u16, encrypt key u8,
// flags u8.
func (v Value) MarshalBinary() ([]byte, error) {
	return v.AppendBinary(make([]byte, 0, ValueSize))
}

// UnmarshalBinary decodes the 12-byte value layout. The padding is ignored,
// as the datapath ignores it.
func (v *Value) UnmarshalBinary(data []byte) error {
	if len(data) != ValueSize {
		return fmt.Errorf("%w: %d bytes, want %d", ErrInvalidValue, len(data), ValueSize)
	}
	v.get((*rawValue)(data))
	return nil
}

func decodeEntry(k *rawKey, v *rawValue) (Entry, error) {
	var e Entry
	if err := e.Key.get(k); err != nil {
		return e, err
	}
	e.Value.get(v)
	return e, nil
}
