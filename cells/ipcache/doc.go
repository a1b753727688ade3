// Package ipcache is the cell that maps IP prefixes to security identities
// and keeps the datapath's ipcache map in step with that mapping.
//
// # What it provides
//
//   - *IPCache: the API owners use to contribute to prefixes, plus Lookup
//     (longest-prefix match), TakeSnapshot and RegisterInitializer for the
//     restoration cell. TakeSnapshot and MapDump hand out the datapath
//     map's entries as [MapEntry] and MapKind the backend as [MapKind],
//     types of this package that an importer can name.
//   - statedb.Table[*Entry], the "ipcache" table: one row per prefix (IPv4
//     and IPv6, masked) with the resolved identity, every owner's
//     contribution and the reconciliation status. Its primary index
//     ([PrefixIndex]) is the exact prefix; [LPMIndex] answers
//     longest-prefix lookups and [OwnerIndex] finds an owner's rows.
//   - A statedb reconciler from the table to the datapath map
//     (internal/ipcachemap): incremental batched writes, retries with
//     backoff (visible in the row's status and in the module's health),
//     and pruning of map entries the table does not have.
//   - Shell commands: ipcache/upsert (waits for the durability point unless
//     --no-wait), ipcache/delete, ipcache/lookup, ipcache/list and
//     ipcache/map-dump, with -o table|json|yaml. ipcache/upsert answers
//     within --identity-allocation-timeout, counted from its start, as
//     identity/allocate does: its allocation and its waits for the map, the
//     map file and the checkpoint share that bound, so that a stalled store
//     or disk makes it fail in time instead of holding its caller (a
//     liveness probe, a script). The error names the bound and what did not
//     finish; what the table has by then stays applied.
//
// It depends on allocator.Allocator, allocator.Config (the allocator
// cell's, for --identity-allocation-timeout), *statedir.Dir, statedb, job
// and a cell.Health provider (the identityd binary has health.Cell, which
// lists every module's scope in /healthz), and uses
// allocator.LocalIdentitySyncer (the checkpoint cell) when the hive has
// one.
//
// # Flags
//
//	--ipcache-map=auto|bpf|file         backend (default auto: bpf when a map can be
//	                                    created and pinned, else file; the choice and
//	                                    its reason are logged)
//	--ipcache-map-pin-path=PATH         bpf pin (default /sys/fs/bpf/identityd/ipcache)
//	--ipcache-map-max-entries=N         capacity (default 512000, up to 16777216)
//	--ipcache-dual-stack                world-ipv4/world-ipv6 labels instead of world
//
// The file backend keeps <state-dir>/ipcache.map. The start fails when
// another agent holds the map ([ErrMapInUse]): two agents on one map
// would prune each other's entries.
//
// # Contributions and precedence
//
// Owners are named by a [ResourceID]. Each owner has at most one
// contribution ([Info]) per prefix; Upsert replaces it, Remove drops it and
// RemoveOwner drops all of an owner's contributions at once (through the
// owner index). A contribution is either metadata (labels and/or a
// requested numeric ID) or a direct identity. A prefix's identity is
// decided as follows:
//
//  1. A direct identity beats all metadata. Among several owners giving a
//     direct identity, the most recent upsert wins; when it is removed, the
//     next most recent one takes over. A direct identity needs no
//     allocation and holds no allocator reference; its tunnel endpoint and
//     encryption key go to the map with it.
//  2. Otherwise the metadata of all owners is merged: the prefix's CIDR
//     labels (labels.FromPrefix: cidr:<prefix> plus the world label), then
//     each owner's labels in ascending owner order, so that for two labels
//     with the same key the greater owner wins, whatever the order of the
//     upserts. If any owner gives a reserved label other than a world
//     label (host, remote-node, kube-apiserver, …), the world label is
//     dropped: such a prefix is not part of the world. A plain CIDR set
//     gets a node-local identity; reserved:remote-node makes it
//     remote-node scoped; labels of other sources make it global (which
//     needs the kvstore).
//  3. A requested ID only matters when no owner gives labels (restoration
//     knows the old identity of the prefix but not its labels): the
//     requested ID of the first owner, in owner order, that has one is
//     passed to the allocator (allocator.WithOldID), which honours it when
//     it is free and in scope. When owners give labels, the labels decide
//     and requested IDs are ignored. A requested ID is a hint for the
//     allocation only: a prefix that already holds an identity for the same
//     label set keeps it.
//
// Each prefix resolved from metadata holds exactly one allocator reference.
// When its merged labels change, the new identity is allocated first and
// the old one released after the table is updated, so the datapath never
// sees an identity without a reference. When the last contribution goes
// (or a direct identity takes over), the reference is released. Writers
// take turns on the table, but releases happen after a writer's turn: a
// release that waits for the store of global identities holds up only its
// own caller.
//
// Input is checked before anything changes: an owner must be a non-empty,
// printable [ResourceID] ([ErrInvalidOwner]); a direct identity or a
// requested ID must be a valid numeric identity
// (identity.NumericIdentity.Validate); the shell commands refuse IPv6 zones
// in addresses and prefixes alike (identities do not carry zones).
//
// Upserts and removals are synchronous: an allocation failure leaves that
// prefix as it was and is returned; the other prefixes of the batch are
// applied. A batch is one allocator batch and one table write transaction.
//
// # Durability
//
// Upsert, UpsertBatch and Remove return once the table has the change,
// before the datapath map does. [IPCache.WaitDurable] is the durability
// point: it returns once the prefixes' rows (or their removal) are written
// to the map (the reconciler's status is Done), the changes are in the map
// file's journal on disk (file backend), and their local identities are in
// the checkpoint's journal (through allocator.IdentitySyncer, when the hive
// has the checkpoint cell), so that the pairs survive a SIGKILL. Each of
// those is one append, whatever the size of the map; concurrent callers
// share the writes, and a prefix whose row and identity are durable
// already costs none. ipcache/delete waits for it too, so that a removal
// survives a SIGKILL. A row whose map write failed makes it fail at once with
// [ErrNotWritten]. A context that ends makes it fail even while a write of
// the map file or the checkpoint hangs on a stalled disk; that write goes
// on and lands once the disk answers. On stop, a hook that runs before the
// reconciler stops waits until it has processed the whole table, so that a
// clean stop keeps every pair, waited for or not.
//
// # Start, restoration and pruning
//
// The order, which the restoration cell relies on:
//
//  1. The ipcache's start hook opens the map and reads its old contents
//     before anything can write; they are kept until
//     [IPCache.TakeSnapshot] hands them over (once).
//  2. Later start hooks run; restoration's start hook (it depends on the
//     ipcache, so it runs after) takes the snapshot and re-creates metadata
//     for the prefixes it keeps, under its owner (e.g. "restored").
//  3. When restoration has finished (Allocator.WaitForRestoration: the
//     restoration registered with the allocator, whatever the order of the
//     cells; at once in a hive without one), the reconciler begins writing
//     to the map; it waits before that, so nothing restoration has yet to
//     see is overwritten by an early row.
//  4. Pruning of entries the table does not have waits until the table is
//     initialized: the ipcache holds its own initializer until restoration
//     has finished, and any other initializer registered with
//     [IPCache.RegisterInitializer] (by restoration, from its constructor
//     or start hook) holds it further until its done function is called.
//     Without such an initializer, the table counts as initialized once
//     restoration has finished (right after start without restoration).
//
// Afterwards the whole map is compared with the table every 10 minutes:
// stale entries are deleted and entries someone else changed are rewritten.
// The file backend's journal is written at most every 200ms after changes
// nobody waited for; the whole file (atomically, emptying the journal) at
// most every 10s, sooner when the journal grows past four times the file,
// and once more on stop.
package ipcache
