// Package etcdstore is the etcd driver of the allocator's global-store
// contract (cells/allocator/globalstore): global identities kept in etcd
// with Cilium's key layout, so that identityd nodes and Cilium agents
// share one etcd.
//
// A new label set costs one transaction; adopting another node's identity
// at most two (one when the cache knows it); the last release of a label
// set on this node one delete. The Store keeps a list+watch cache of every
// master key, re-creates this node's keys after a lost lease (keys found on
// an earlier lease of this agent, which etcd revived after an outage, are
// its own and moved to the current lease), checks them
// every --kvstore-periodic-sync, and collects unused master keys at
// --identity-gc-interval. Concurrent creations share transactions (see
// batch.go). Follower is the same cache, read-only, for another etcd: the
// cluster mesh uses it for remote clusters.
//
// The store keeps no list of this node's references of its own: it reads
// the allocator's (globalstore.References) when it writes them again, and
// keeps in each globalstore.Reference the revision it last wrote the
// reference key at, which the release's delete compares.
//
// # Jobs
//
// Each loop is a hive job of the module, with its own health scope:
// global-identities-watch (the master-key cache), lease-repair,
// identity-gc (a timer), kvstore-periodic-sync (a timer) and, when the
// first listing outlasts --allocator-list-timeout, cluster-check. The
// node-name scope reports the claim of --node-name.
//
// # Flags
//
// Its own:
//
//	--kvstore-periodic-sync         interval between checks of this node's keys (5m; 0 disables)
//
// Shared with the other stores (globalstore.Config, registered by the
// allocator cell); --identity-heartbeat-timeout is the CRD store's only:
//
//	--allocator-list-timeout        bound on waiting for the first listing at start (3m)
//	--identity-gc-interval          interval between GC runs (15m; 0 disables)
//	--identity-gc-rate-interval     window of the GC's deletion rate limit (1m)
//	--identity-gc-rate-limit        deletions per window (2500)
//
// # Modes
//
// The store serves --identity-allocation-mode=kvstore (the default) and
// the two double-write modes, doublewrite-readkvstore (it decides the IDs)
// and doublewrite-readcrd (it is written the IDs the CRDs decide; the
// double-write cell, cells/allocator/doublewrite, composes the two stores).
// In crd mode its cell builds no store, starts nothing and reports health
// OK, even when the kvstore cell has an etcd client.
//
// # Stopping
//
// The store's stop ends its loops (the hive has stopped their jobs
// already), then revokes the node's lease, which removes its reference
// keys at once. Its etcd work shares the kvstore's stop deadline
// (kvstore.StopBudget), which also ends callers' requests still in flight,
// and releases made once the stop began send no delete: with etcd gone the
// stop takes seconds, warns that the revoke failed, and the references
// expire with the lease's TTL. The collector election's campaign, ended by
// the stop, deletes nothing on its way out (its key goes with the lease),
// so no job waits on an etcd that is gone.
package etcdstore
