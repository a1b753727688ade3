// Package allocator is the identity allocator cell: one object, Allocator,
// through which an agent allocates, looks up, releases and watches security
// identities.
//
// # What it does
//
//   - Reserved label sets resolve to their fixed identity without
//     allocation, by the rules of identity.ReservedResolver under the
//     Config's Cilium options (--enable-well-known-identities,
//     --policy-cidr-match-mode); releasing one is a no-op.
//   - Node-local and remote-node label sets (identity.ScopeForLabels) are
//     numbered in memory, sequentially with wrap-around from 0x01000001 and
//     0x02000001. A requested old ID (WithOldID) is honoured when it is in
//     the set's scope and free, even if withheld, and the next new number
//     is sought above it (so that after restoration new numbers go above
//     every restored one); withheld IDs are skipped
//     otherwise; when every other ID is taken a withheld-but-free one is
//     handed out with a warning, and only then ErrLocalSpaceExhausted.
//   - Global label sets go to the globalstore.Backend of the store driver
//     of --identity-allocation-mode (kvstore: cells/allocator/etcdstore,
//     with the kvstore cell; crd: cells/allocator/crdstore). The
//     allocator counts this node's references itself: only a label set's first reference and last
//     release reach the backend, and a set this node holds costs no
//     request. Without a backend, a global label set fails with
//     ErrNoGlobalBackend.
//   - Label sets are validated (labels.Labels.Validate) before a new
//     identity is made for them, so nothing unrepresentable reaches etcd.
//
// Hits and non-final releases only take a read lock and change the
// reference count atomically; only the first reference and the last
// release take the scope's write lock.
//
// # Observing
//
// Every identity that appears or disappears, reserved, local or global, is
// published three ways, in order, by one dispatcher goroutine:
//
//   - the Allocator's stream.Observable[Change]: a new subscriber first gets
//     every current identity as ChangeUpsert, then ChangeSync (once the
//     global identities were listed), then live changes;
//   - identity handlers registered by other cells through the
//     "identity-handlers" value group (NewHandler): one call per batch of
//     changes, with an add and a delete of the same ID in one batch
//     cancelling out; AllocateBatch delivers its identities in one batch;
//   - the statedb table "identities" (statedb.Table[Entry], indexes
//     EntryIDIndex and EntryLabelsIndex), with the reference count and the
//     source (reserved, local, global, restored) of every identity. The
//     table is written in short, paced transactions, so during a burst of
//     new identities it lags behind and catches up after the burst
//     (docs/architecture.md).
//
// Allocation never waits for any of them. During a burst the dispatcher
// pauses briefly between passes, so that observers and handlers get larger
// batches and the allocating goroutines are not slowed by a hand-over per
// change.
//
// # Flags
//
// The Config's fields, each with its flag: --cluster-id, --cluster-name,
// --max-connected-clusters, --identity-allocation-mode,
// --identity-allocation-timeout and Cilium's reserved-identity options.
//
// # Shell commands
//
//	identity/allocate [--old-id N] [--no-wait] [-o table|json|yaml] <label>...
//	identity/release <id>
//	identity/get [-o …] <id> | <label>...
//	identity/list [--source reserved|local|global|restored|remote] [-o …]
//	db/show identities
//
// With a LocalIdentitySyncer in the hive (the checkpoint cell provides
// one), identity/allocate answers a local identity only once it is in the
// checkpoint on disk, unless --no-wait; if the checkpoint cannot be written
// within --identity-allocation-timeout (counted from the command's start)
// it drops the reference it took and fails.
//
// # Order by contract
//
// Other cells register with the allocator through invokes, which run
// before any start hook: identity handlers (NewHandler), the restoration
// that local allocations wait for (NewRestoration) and the finalizers its
// stop hook runs (NewFinalizer). Until a registered restoration is done,
// local allocations that are not restoration's own (AsRestored, or a
// context from Restoring) wait, bounded by --identity-allocation-timeout;
// WaitForRestoration tells when it is done. The stop hook runs the
// finalizers first (the checkpoint's final write): every cell that uses
// the allocator depends on it, so their stop hooks have run by then.
//
// # Stores and remote clusters
//
// The allocator imports no store: it consumes the contract of
// cells/allocator/globalstore. The Backend of the globalstore.Driver of the
// configured mode serves global label sets; a globalstore.Backend provided
// on its own (tests) is used instead, and crd mode without a crd driver
// fails the hive's start. A globalstore.Remote (cells/allocator/clustermesh)
// adds other clusters' identities, source "remote", to lookups, Observe
// and handlers. Both are cells with hooks and jobs of their own, built
// before the allocator, which binds the globalstore.Sinks they report to
// when it is built: they start before its start hook and stop after its
// stop hook.
package allocator
