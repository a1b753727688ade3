package ipcache

import (
	"fmt"
	"net/netip"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/ipcachemap"
)

// MapKind names a datapath map backend.
type MapKind string

// Backends of the datapath map. Config.IPCacheMap takes one of them as a
// string; IPCache.MapKind reports MapKindBPF or MapKindFile.
const (
	// MapKindAuto (a configuration value only) uses bpf when a map can be
	// created and pinned, else file.
	MapKindAuto = MapKind(ipcachemap.KindAuto)
	// MapKindBPF is a pinned BPF LPM trie, the map a datapath program reads.
	MapKindBPF = MapKind(ipcachemap.KindBPF)
	// MapKindFile is an in-memory table persisted to <state-dir>/ipcache.map,
	// for runs without the privileges to create BPF maps.
	MapKindFile = MapKind(ipcachemap.KindFile)
)

// MapKey selects a datapath map entry: an IP prefix within a cluster.
type MapKey struct {
	// Prefix is the masked IPv4 or IPv6 prefix.
	Prefix netip.Prefix
	// ClusterID is the cluster mesh ID of the prefix's owner; 0 is the
	// local cluster.
	ClusterID uint16
}

// String returns "prefix", or "prefix@cluster" for a non-zero cluster ID.
func (k MapKey) String() string {
	if k.ClusterID == 0 {
		return k.Prefix.String()
	}
	return fmt.Sprintf("%s@%d", k.Prefix, k.ClusterID)
}

// MapValue is what the datapath learns about a prefix.
type MapValue struct {
	// Identity is the security identity of the prefix.
	Identity identity.NumericIdentity
	// TunnelEndpoint is the IPv4 address of the node to tunnel to, or the
	// zero Addr for none.
	TunnelEndpoint netip.Addr
	// EncryptKey is the IPsec key index, 0 for none.
	EncryptKey uint8
	// Flags holds the entry's flag bits (bit 0: skip the tunnel).
	Flags uint8
}

// MapEntry is one entry of the datapath map, as TakeSnapshot and MapDump
// return it.
type MapEntry struct {
	Key   MapKey
	Value MapValue
}

// mapEntries converts the map's own entries at the package's boundary. The
// key and value types have the map's layout, so each converts field for
// field.
func mapEntries(in []ipcachemap.Entry) []MapEntry {
	if in == nil {
		return nil
	}
	out := make([]MapEntry, len(in))
	for i, e := range in {
		out[i] = MapEntry{Key: MapKey(e.Key), Value: MapValue(e.Value)}
	}
	return out
}
