package allocator

import (
	"context"

	"github.com/identityd/identityd/identity"
)

// LocalIdentitySyncer makes the local identities durable: Sync returns nil
// once every local identity the allocator had handed out when Sync was
// called is on disk, so that the next agent on the same state directory
// gives each its number back, even after a crash (SIGKILL). A burst of
// concurrent calls shares writes. The checkpoint cell provides it; in a hive
// without one, nothing keeps local identities across restarts.
//
// It is defined here, beside the allocator, so that the cells that answer
// with local identities (the ipcache, identity/allocate) can wait for the
// checkpoint without importing it.
type LocalIdentitySyncer interface {
	Sync(ctx context.Context) error
}

// IdentitySyncer is a LocalIdentitySyncer that can make given identities
// durable: SyncIdentities returns nil once each of them survives a crash,
// at once for an identity that is durable already (a label set the node
// held before), so that an answer that changes nothing on disk waits for
// no write. The checkpoint cell's syncer implements it with a journal: one
// small write per durable answer, shared by the callers waiting at the
// same moment, instead of a rewrite of every local identity.
type IdentitySyncer interface {
	LocalIdentitySyncer
	SyncIdentities(ctx context.Context, ids ...*identity.Identity) error
}
