package allocator

import (
	"strconv"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"

	"github.com/identityd/identityd/identity"
)

// TableName is the name of the identities table.
const TableName = "identities"

// EntryIDIndex finds an identity by its numeric ID (primary index).
var EntryIDIndex = statedb.Index[Entry, identity.NumericIdentity]{
	Name: "id",
	FromObject: func(e Entry) index.KeySet {
		return index.NewKeySet(index.Uint32(uint32(e.Identity.ID)))
	},
	FromKey: func(id identity.NumericIdentity) index.Key { return index.Uint32(uint32(id)) },
	FromString: func(s string) (index.Key, error) {
		id, err := identity.ParseNumericIdentity(s)
		return index.Uint32(uint32(id)), err
	},
	Unique: true,
}

// EntryLabelsIndex finds an identity by the canonical string of its labels.
var EntryLabelsIndex = statedb.Index[Entry, string]{
	Name: "labels",
	FromObject: func(e Entry) index.KeySet {
		return index.NewKeySet(index.Key(e.Identity.Labels.CanonicalBytes()))
	},
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// NewTable creates the identities table; the allocator cell provides it
// read-only as statedb.Table[Entry].
func NewTable(db *statedb.DB) (statedb.RWTable[Entry], error) {
	return statedb.NewTable(db, TableName, EntryIDIndex, EntryLabelsIndex)
}

// TableHeader implements statedb.TableWritable.
func (Entry) TableHeader() []string {
	return []string{"ID", "Labels", "Scope", "RefCount", "Source"}
}

// TableRow implements statedb.TableWritable.
func (e Entry) TableRow() []string {
	return []string{
		e.Identity.ID.String(),
		e.Identity.Labels.String(),
		scopeName(e.Identity.ID),
		strconv.Itoa(e.RefCount),
		string(e.Source),
	}
}

func scopeName(id identity.NumericIdentity) string {
	if id.IsReserved() {
		return "reserved"
	}
	return id.Scope().String()
}
