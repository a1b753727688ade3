// Package restoration is the cell that keeps local security identities and
// the datapath's prefix → identity pairs stable across agent restarts.
//
// # What it does
//
// The Restorer's start hook runs, in this order:
//
//  1. Load the checkpoint (checkpoint.Checkpoint.Load). A missing file means
//     nothing to restore; a corrupt file was set aside by the loader and
//     restoration goes on with the ipcache map alone; invalid entries are
//     skipped.
//  2. Withhold every old numeric ID, so that no identity the next step has
//     to create anew takes the number of another one.
//  3. Allocate each old label set asking for its old ID, as one
//     allocator batch marked restored (so identity handlers hear of them
//     in one batch). Entries whose label set now has another scope, or
//     needs a global identity, are skipped with a warning.
//  4. Unwithhold those IDs: the restored identities hold them now. Then
//     withhold until the release every other local ID the state files
//     name (checkpoint.LoadResult.Seen: the checkpoint, the journal and
//     their kept copies) and, when the identity journal was damaged or the
//     checkpoint corrupt, every ID of each local scope up to a margin above
//     the highest one seen that no restored identity holds: an answer
//     whose record was destroyed holds one of them (Counters.SeenWithheld,
//     UnknownWithheld; Status.JournalDamage reports the damage).
//  5. Take the snapshot of the old ipcache map and, for every prefix of
//     this cluster whose identity was node-local (or ingress) without a
//     tunnel endpoint, contribute metadata under the ipcache owner
//     "restored": the restored label set when the checkpoint had the
//     identity (the ipcache's merge with the prefix's CIDR labels gives the
//     same set, and so the same identity); otherwise a requested ID, which
//     is withheld until the release. When several prefixes shared an
//     unknown ID, or the label set does not derive from the prefix, the old
//     number is kept as a direct identity instead, because per-prefix CIDR
//     label sets could keep it for one prefix only.
//     The checkpoint's ID ↔ label-set pairs win over the map: an entry
//     whose ID the checkpoint gives to a CIDR label set naming another
//     prefix (two prefixes on one ID, IDs shuffled between prefixes) is
//     skipped, logged and counted (Counters.MapEntriesSharedID,
//     MapEntriesOtherLabels), so that the prefix's owner, upserting it
//     again, gets the checkpoint's number for its own label set.
//  6. Mark restoration's ipcache initializer done: the ipcache reconciler
//     may now prune stale entries of the datapath map.
//
// Steps 1 to 5 run in the start hook, except that the prefixes of restored
// identities are added to the ipcache by a job right after the start
// hooks, followed by step 6: their identities already hold their old
// numbers, so any owner upserting such a prefix meanwhile resolves it to
// the same identity, and the map keeps the old entries until step 6. The
// prefixes of unknown label sets (requested IDs) are added in the hook, as
// an early upsert by another owner would give them a fresh number.
// Restorer.Done is closed after the hook (local allocations wait for it,
// see Ordering), Restorer.Ready after step 6.
//
// Nothing of this fails the start but an identity journal that cannot be
// opened (checkpoint.ErrJournalUnusable), with which no local identity
// could be answered durably: each other problem is logged and counted
// (Counters) and restoration continues with what it can use.
//
// A job then waits for the grace period and calls Release: the "restored"
// metadata is removed, each restored identity loses the restorer's
// reference and the withheld IDs are unwithheld. Identities and prefixes
// taken up in the meantime keep their numbers; the others are freed. An
// agent stopped before the grace period ends keeps everything held, so
// that its final checkpoint still lists the restored identities.
//
// # Ordering
//
// The order does not depend on where the cells are listed; it is kept by
// contracts with the allocator and the ipcache:
//
//   - The Restorer registers with the allocator as its
//     allocator.Restoration (allocator.NewRestoration). Until Restorer.Done
//     is closed, which the start hook does however it ends, every local
//     allocation that is not restoration's own waits for it, bounded by
//     its context and --identity-allocation-timeout: no identity allocated
//     before restoration can take a restored identity's number.
//     Restoration's own allocations are marked restored, and the ipcache
//     upserts of its start hook run under allocator.Restoring, so they do
//     not wait for themselves; its jobs run after Done.
//   - The checkpoint writes nothing, and the ipcache reconciler writes
//     nothing to the datapath map, before restoration has finished
//     (Allocator.WaitForRestoration); the ipcache prunes nothing before
//     restoration's initializer (registered in the Restorer's constructor)
//     is done. So neither file changes before restoration has read it.
//   - Stopping, the Restorer keeps what it holds; the final checkpoint is
//     written by the allocator's stop hook (the checkpoint's
//     allocator.Finalizer), after the stop hooks of every cell that uses
//     the allocator, this one included.
//
// Restoration depends on the allocator, the checkpoint and the ipcache, so
// its start hook runs after theirs. A start hook of another cell that
// allocates a local identity must depend on *restoration.Restorer, so
// that it runs after restoration's; without that dependency it would wait
// for a hook that may run after it. Other work allocates from a job.
//
// # Cell
//
// Cell provides *Restorer and the identity/restore-status shell command.
// It depends on allocator.Allocator, *checkpoint.Checkpoint,
// *ipcache.IPCache (and its Config, for dual-stack world labels), job and
// health, and reads the old map through the ipcache's own types
// (ipcache.MapEntry). An AutomaticGracePeriod is optional and only chooses
// the default grace period: restoration does not depend on the kvstore, so
// that it can be composed without one.
//
// # Flags
//
//	--identity-restore-grace-period=DURATION   how long restored state is held
//	                                           (default 0: automatic, the hive's
//	                                           AutomaticGracePeriod, else
//	                                           EmbeddedGracePeriod; the identityd
//	                                           binary provides 30s with the embedded
//	                                           etcd, 10m with external kvstore
//	                                           endpoints)
//
// # Commands
//
//	identity/restore-status [-o table|json|yaml] [--held]
//
// prints the state (pending, holding, released), the counters, what is still
// held and when the release runs; --held lists the held identities.
package restoration
