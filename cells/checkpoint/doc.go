// Package checkpoint keeps the node's local identities on disk, so that a
// restarted agent can give every CIDR-like label set its old numeric
// identity and policy does not drop packets while it comes back.
//
// The file is <state-dir>/local_allocator_state.json in Cilium v1.16's
// format: a compact JSON array of {"id": N, "labels": {key: {"key", "value",
// "source"}}} holding the node-local and remote-node-scope identities. A
// Cilium agent and identityd can restore from each other's file.
//
// # Cell
//
// Cell provides *Checkpoint. It depends on allocator.Allocator and
// *statedir.Dir. The checkpoint observes the allocator's change stream and
// asks for a write on every local allocation and every release to zero;
// writes are coalesced to at most one per --identity-checkpoint-interval
// (default 10s, 0 writes on every change) and each writes a snapshot of
// Allocator.LocalIdentities. A final write happens on stop, after every cell
// that uses the allocator has stopped: it is the allocator's finalizer
// (allocator.NewFinalizer), which the allocator's stop hook runs before the
// allocator stops its own work; every user of the allocator depends on it,
// so their stop hooks have run by then, whatever the order of the cells. A
// pre-stop hook, which hive runs before every normal stop hook, notes the
// local identities live when the stop begins; the final
// write keeps those that other cells' stop hooks released since (unless
// their number or label set was taken again), so that releasing on the way
// down does not renumber them at the next start.
//
// Every write of the file is atomic and durable: a temporary file beside
// the target, fsync, rename, fsync of the directory; mode 0600. The
// journal is written in place, appended to and fsynced, mode 0600.
//
// # Journal
//
// Every local allocation and release to zero is also a record of the
// journal beside the checkpoint (JournalFileName, identityd's own file;
// see docs/formats.md): the checkpoint file is its snapshot. A durable
// answer appends to the journal instead of rewriting the file, so its cost
// does not grow with the number of identities the node holds.
// Checkpoint.SyncIdentities is that durability point
// (allocator.IdentitySyncer, which identity/allocate and the ipcache's
// WaitDurable use): it returns once a record of each identity is on disk,
// with one write and one fsync shared by every caller waiting at that
// moment, and at once for an identity already durable (a label set the
// node held before). Each checkpoint write takes the journal's place: once
// the file is on disk the journal is emptied of the records it holds.
// Restoration reads the file and replays the journal's valid records over
// it, then the records after damage that still verify; a copy of the
// damaged journal is kept as <journal>.corrupt-<unix time>, and the agent
// logs it. The journal's header names the checkpoint file it follows (its
// size and checksum): over a file replaced since (an older copy restored,
// a Cilium agent's checkpoint, a deleted file) its records are replayed
// and the damage reported the same way, unless the journal ends with the
// record naming the file found that each write appends before writing it
// (a crash before the journal was emptied: no damage). Load also returns
// every local number the files and their kept copies name
// (LoadResult.Seen), which restoration withholds.
//
// Checkpoint.Sync makes every local identity durable with a whole write:
// it returns once a write that began after the call has succeeded, writing
// at once whatever the interval; callers that wait during a running write
// share the next one. A caller of either whose context ends stops waiting
// even while a write hangs on a stalled disk; the write goes on and lands
// once the disk answers. Neither writes before restoration has finished,
// and so loaded the file (Allocator.WaitForRestoration; at once in a hive
// without restoration): a start hook that calls them may wait for its own
// end.
//
// # Restoration
//
// Checkpoint.Load (or Loader.Load for a path) returns the valid identities
// and a Report. A missing file means nothing to restore. A file that is
// unreadable, not a checkpoint or larger than MaxFileSize is renamed to
// local_allocator_state.json.corrupt-<unix time> and the agent starts
// without restoration; a file with some invalid entries is restored
// partially and a copy is kept as .invalid-<unix time>. No bad file is ever
// deleted or overwritten.
//
// # Commands
//
//	checkpoint/write          write the checkpoint now
//	checkpoint/show [file]    print the identities of the checkpoint file
//
// # Status and metrics
//
// Checkpoint.Status reports the last write (time, duration, size, entries),
// the last error and counters of writes, failures, loads, corrupt files and
// invalid entries. The cell exports them as the identityd_checkpoint_*
// metrics (see cells/metrics).
//
// # Encoding
//
// AppendJSON encodes deterministically (identities by ID, labels by key), so
// that the same state always gives the same bytes; Decode parses and
// validates any valid JSON in the format, and never panics. Both are
// hand-written for speed: 100,000 CIDR identities encode and write in a
// fraction of the time Cilium takes.
package checkpoint
