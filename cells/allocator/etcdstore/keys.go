package etcdstore

import (
	"fmt"
	"strings"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/identityd/identityd/identity"
)

// The key layout of a label set and of an ID, for the tools that read and
// write the keys without a running store (`identityd migrate`).

// MasterKey is the master key of id.
func MasterKey(id identity.NumericIdentity) string { return masterKey(id) }

// ParseMasterKey returns the ID of a master key: what follows
// MasterKeyPrefix must be a global identity, not a reserved one.
func ParseMasterKey(key string) (identity.NumericIdentity, error) {
	suffix := strings.TrimPrefix(key, MasterKeyPrefix)
	id, err := identity.ParseNumericIdentity(suffix)
	if err != nil || id == identity.InvalidIdentity || id.Scope() != identity.ScopeGlobal || id.IsReserved() {
		return 0, fmt.Errorf("invalid numeric identity %q", suffix)
	}
	return id, nil
}

// ReferencePrefix is the prefix of the reference keys of the label set
// whose canonical string is key, cleaned as Cilium cleans it: two label
// sets with one prefix cannot be told apart in this layout.
func ReferencePrefix(key string) string { return referencePrefix(key) }

// LockPrefix is the prefix of the allocation locks Cilium agents take on
// the label set whose canonical string is key.
func LockPrefix(key string) string { return lockPrefix(key) }

// CheckKeyLayout returns an error wrapping ErrKeyLayout when the label set
// whose canonical string is key cannot be stored: its reference or lock
// keys, cleaned as Cilium cleans them, leave their prefix.
func CheckKeyLayout(key string) error { return checkKeyLayout(key) }

// ReferencedIDs returns the IDs that the reference keys in kvs name, each
// with the number of keys that name it. kvs is a read of the prefix
// ReferencePrefix returns for a label set; keys under it that belong to
// other label sets (whose strings extend this one with "/") are left out.
// This is how a node settles a label set held at several master keys: it
// adopts the one ID its references name, and waits while they name
// several.
func ReferencedIDs(prefix string, kvs []*mvccpb.KeyValue) (map[identity.NumericIdentity]int, error) {
	ids := map[identity.NumericIdentity]int{}
	for _, kv := range kvs {
		if !isReferenceOf(kv.Key, prefix) {
			continue
		}
		id, err := identity.ParseNumericIdentity(string(kv.Value))
		if err != nil || id == identity.InvalidIdentity {
			return nil, fmt.Errorf("reference key %s holds %q, not a numeric identity", kv.Key, kv.Value)
		}
		ids[id]++
	}
	return ids, nil
}
