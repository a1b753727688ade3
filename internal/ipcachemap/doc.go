// Package ipcachemap holds the datapath map behind the ipcache: a table from
// (cluster ID, IP prefix) to security identity, tunnel endpoint, encryption
// key index and flags, in the binary layout Cilium v1.16 uses for its ipcache
// map (see FORMATS.md §5).
//
// Two backends implement [Map]:
//
//   - "bpf": a pinned BPF LPM trie (default /sys/fs/bpf/identityd/ipcache).
//     Lookups are the kernel's longest-prefix match, so what the agent writes
//     is exactly what a datapath program would see.
//   - "file": an in-memory table persisted atomically to a file in the state
//     directory, for runs without the privileges to create BPF maps. Writes
//     are cheap; [Map.Sync] (or the write-behind delay) persists them. With
//     [Config.Journal], Sync appends the changes to a journal beside the
//     file and [Map.Compact] writes the whole file, emptying the journal;
//     [Open] replays the journal over the file: its valid records, then
//     those found intact after damage; a journal that follows another
//     file than the one found (replaced, deleted) is replayed over it and
//     reported, a copy kept aside, unless it ends with the record naming
//     the file found that [Map.Compact] writes first (a crash before the
//     journal was emptied, no damage).
//
// [Open] picks the backend ("auto" prefers bpf) and, before returning the map
// to anyone who could write to it, reads its old contents into
// [OpenInfo.Snapshot]: restoration after a restart needs the prefix →
// identity pairs the previous run left behind. An open map holds an
// exclusive lock beside it until [Map.Close], so a second opener (another
// agent, or a second hive in one process) gets [ErrInUse] before it can
// read or prune anything.
//
// Typical use by the ipcache cell:
//
//	m, info, err := ipcachemap.Open(ipcachemap.Config{
//		Kind:     ipcachemap.KindAuto,
//		PinPath:  ipcachemap.DefaultPinPath,
//		FilePath: stateDir.Join(ipcachemap.FileName),
//	})
//	if err != nil { return err }
//	log.Info("ipcache map opened", "kind", m.Kind(), "path", m.Path(), "reason", info.Reason)
//	restore(info.Snapshot)
//	...
//	m.UpdateBatch(entries) // then m.Sync() after each reconciliation round
package ipcachemap
