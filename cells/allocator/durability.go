package allocator

import "context"

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
