package globalstore

import (
	"context"
	"errors"

	"github.com/cilium/hive/cell"

	"github.com/identityd/identityd/identity"
)

// Mirror is a store that can serve as the write-only store of a
// double-write mode (identity.AllocationMode.DoubleWrite): another store,
// the read store, decides every ID, and the mirror keeps the same ID for
// the same label set, with this node's use of it, so that its own garbage
// collection sees the use and a later switch to it as the read store finds
// the IDs the cluster already has.
//
// A mirror is started with the same References as the read store (the
// allocator's record): what it writes again after a loss of its own (an
// etcd lease, a deleted object) is what the read store holds, and each
// store's record of this node's uses lists them.
type Mirror interface {
	Backend

	// Mirror writes ref's identity, ID and label set, when the store does
	// not hold it, and this node's use of it. It never writes over
	// another label set's identity: when the store gives ref's ID to
	// another label set it writes nothing of ref and returns an error
	// that wraps ErrIDTaken and names both label sets. The read store
	// has recorded ref before the call; Release is called with it later,
	// whether or not Mirror succeeded. Any other error leaves the write
	// to a later call.
	Mirror(ctx context.Context, ref *Reference) error
}

// ErrIDTaken: the write-only store of a double-write mode gives the ID the
// read store decided to another label set.
var ErrIDTaken = errors.New("the ID belongs to another label set in this store")

// MirrorGroup is the hive value group of the stores a double-write mode
// composes.
const MirrorGroup = "globalstore-mirrors"

// MirrorDriver is a store as its cell offers it to a double-write mode:
// the Mirror of the pure mode Store (kvstore or crd). A nil Mirror means
// the store is not built in the configured mode.
type MirrorDriver struct {
	Store  identity.AllocationMode
	Mirror Mirror
}

// MirrorOut adds a MirrorDriver to MirrorGroup. Return it from a
// constructor given to cell.Provide.
type MirrorOut struct {
	cell.Out

	Mirror MirrorDriver `group:"globalstore-mirrors"`
}

// NewMirror returns the MirrorOut of m for the pure mode store. A store
// that is not built passes a nil interface, not a nil pointer of its type.
func NewMirror(store identity.AllocationMode, m Mirror) MirrorOut {
	return MirrorOut{Mirror: MirrorDriver{Store: store, Mirror: m}}
}

// Collector is a store that elects one node of the cluster to collect its
// unused identities; the work that concerns the whole cluster, as the
// double-write modes' report of the two stores' differences, runs there.
type Collector interface {
	// Collecting reports whether this node is the elected collector now.
	Collecting() bool
}
