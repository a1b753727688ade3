// Package crdstore is the Kubernetes CRD driver of the allocator's
// global-store contract (cells/allocator/globalstore): global identities
// kept as Cilium's cilium.io/v2 CiliumIdentity objects, written exactly as
// Cilium v1.16's CRD backend writes them, so that identityd nodes and
// Cilium agents in CRD mode share one API server; each node's uses are its
// identityd.io/v1 IdentityNode object; one node of the cluster, the holder
// of a coordination.k8s.io/v1 Lease, collects unused identities. The
// design and its rules are docs/crd-store.md; why racing nodes never give
// one label set two identities is below ("One object per label set").
//
// The store serves --identity-allocation-mode=crd and the two double-write
// modes, doublewrite-readcrd (it decides the IDs) and
// doublewrite-readkvstore (it is written the IDs etcd decides; the
// double-write cell, cells/allocator/doublewrite, composes the two
// stores). In kvstore mode its cell builds no store.
//
// A new label set goes to the first ID of its probe sequence (from the
// SHA-256 of its canonical labels) that the cache does not show held by
// another label set: one create in the common case. A label set whose
// object on that sequence the cache shows costs no request, duplicated by
// Cilium's agents or not (unless its object carries the heartbeat mark,
// which is removed), and a release none: both change the IdentityNode,
// which one writer sends coalesced. Of a label set's several objects, every
// node answers the one the rule picks, on which an object on the sequence
// has a head start over the objects off it: a young object of a Cilium
// agent is adopted only once the walk of the sequence found none there
// (docs/crd-store.md). There is no lock per node: concurrent allocations
// run in parallel.
//
// The Store keeps a list+watch cache of CiliumIdentity objects of this
// cluster's range (client-go's Reflector: a listing, a watch from its
// resourceVersion, a new listing after 410 Gone) indexed by ID and by
// canonical labels; no node watches the IdentityNode objects of others.
// Objects whose name is not an ID of the range or whose security-labels
// are not a valid label set are left out and counted. The store's start
// hook installs or updates the three CRDs (RegisterCRDs) when they are
// missing or outdated.
//
// # One object per label set
//
// Why identityd nodes that allocate a label set L at the same moment, with
// caches that lag each other, never hold two IDs for it:
//
//  1. An ID names at most one object (object names are unique).
//  2. Without deletions: a node places L at slot(k) of L's probe sequence
//     only after seeing slot(0..k-1) held by other label sets. Those
//     objects stay, so a node B that does not see that object yet walks the
//     same sequence, gets AlreadyExists or sees another label set at each
//     of slot(0..k-1), and then AlreadyExists with L at slot(k): it adopts
//     the object. Two objects of L would need a free slot before slot(k),
//     which does not exist.
//  3. With deletions, the only way to a second object is a slot before
//     slot(k) that becomes free while a node that does not see L's object
//     at slot(k) yet walks L's sequence. So the collector never deletes
//     such a slot while L's object is young: created less than maxCacheLag
//     plus stepClockMargin before the run (the fence, fenced), decided on
//     the collector's own cache. An older object is in every node's cache,
//     and a walk looks at its cache once more just before it creates
//     (recheck): a node that allocates L then adopts L's object instead of
//     creating at the freed slot. The collector deletes only objects it
//     marked at least MinHeartbeatTimeout earlier (the shortest heartbeat
//     timeout, and the shortest grace without Cilium agents), with the
//     resourceVersion it planned on as precondition. A creator whose last
//     look shows the slot marked at least stepNoteAge before announces its
//     step on it first, which fails a delete planned on the older state and
//     defers a later one by gcStepWindow; it creates within maxAnnounceAge
//     of its first announcement, or walks again. A creator whose last look
//     shows the slot unmarked, or marked more recently, created its object
//     more than maxCacheLag plus stepClockMargin before any run that
//     deletes it (the mark it did not see is at most maxCacheLag older than
//     the look, and MinHeartbeatTimeout is twice maxCacheLag), and that
//     run's cache shows the new object. A mark that does not parse is
//     announced. This assumes that a node's cache does not lag by more
//     than maxCacheLag, and that the nodes' clocks disagree, plus the time
//     a creator stalls between its last look and its create, by less than
//     stepClockMargin.
//  4. Where L has several objects (Cilium agents made them), every node
//     answers the rule's pick among all of them at the moment it decides
//     (settle): the cache decides only when it shows the object the walk
//     of L's sequence reaches first, or when its pick ranks more than
//     maxCacheLag before now; otherwise the allocation finds or creates the
//     sequence's object at the server first. A later object ranks later
//     (walkHeadStart), so the pick stays the pick.
//
// # Jobs
//
// Each loop is a hive job of the module, with its own health scope:
// global-identities-watch (the cache), identity-node-writer (this node's
// IdentityNode), identity-node-watch (a watch of that one record, which
// writes it again at once when it is deleted), identity-node-renew (a
// timer at a third of the lease),
// identity-unmark (removes the heartbeat mark from identities this node
// uses, and re-creates deleted ones; idle on a node given
// globalstore.AdoptOnly, which writes no CiliumIdentity and adopts no
// marked one), identity-splits (reports label sets this node holds under another
// ID than the rule's), and, unless the collection's interval is 0, identity-gc-election
// (client-go's leader-election algorithm over the coordination.k8s.io Lease
// identity-gc-<cluster ID> in --identity-gc-lease-namespace, and over the
// deprecated IdentityLease of earlier versions, which the collector holds
// as well so that they do not collect beside it during an upgrade; its
// health names the node that collects), identity-gc (the collection's timer, whose
// runs happen only on the elected node) and identity-gc-endpoints (its
// health says whether the collector found Cilium's endpoint CRDs).
//
// # Flags
//
//	--identity-node-lease-ttl     how long this node's IdentityNode counts after its renewal (15m; at least 25s)
//	--identity-gc-cilium-agents   Cilium agents may use the identities (default): the heartbeat timeout is then at least MinHeartbeatTimeoutBesideCilium, else MinHeartbeatTimeout
//
// # Metrics
//
//	identityd_crd_allocations_total{outcome}      created, adopted, conflict, exhausted, error
//	identityd_crd_ignored_objects_total           object versions left out of the cache
//	identityd_crd_split_label_sets_total          label sets that came to have two objects
//	identityd_crd_split_label_sets_foreign_total  of those, the ones with an object identityd's walk did not place
//	identityd_crd_split_label_sets                label sets with two objects now
//	identityd_crd_split_label_sets_held           label sets this node holds under another ID than the rule's
//	identityd_crd_split_label_sets_held_total     times a label set this node holds came to be one
//	identityd_crd_identities_taken_total          IDs this node uses found with another label set's object
//	identityd_crd_heartbeat_marks_removed_total   marks removed by this node
//	identityd_crd_identity_node_writes_total{outcome}
//	identityd_crd_identity_node_recreated_total   own record found deleted and written again
//	identityd_crd_identity_gc_entries{status}     marked, deleted, skipped, unmarked, reclaimed
//	identityd_crd_identity_gc_runs{outcome}       success, failure
//	identityd_crd_identity_gc_kept{reason}        used, fenced (last run)
//	identityd_crd_identity_gc_nodes_deleted_total
//	identityd_crd_identity_gc_leader              1 on the node that collects
//
// # Garbage collection
//
// The collector (gc.go), one node per cluster (election.go), decides on
// the store's cache of CiliumIdentity objects, read after the time it
// measures marks against (a stale entry only fails a write's
// resourceVersion precondition), on its own consistent listing of
// IdentityNode objects, and on a listing of Cilium's CiliumEndpoint
// and CiliumEndpointSlice objects (endpoints.go), which name the
// identities Cilium agents use: it marks identities no live IdentityNode
// lists, no endpoint object names and no fence needs (a fence lasts while
// the object that needs it is young), deletes those marked a heartbeat timeout
// earlier, unless a walk announced a step over them within gcStepWindow,
// with their UID and resourceVersion as preconditions, paced by a
// rate limit, and deletes IdentityNode objects a lease after their lease
// ended. Its settings are a GCConfig (DefaultGCConfig unless the hive
// provides one).
package crdstore
