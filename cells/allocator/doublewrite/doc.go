// Package doublewrite serves the double-write identity allocation modes of
// Cilium v1.17, the steps of a move between the etcd store and the CRD
// store without renumbering:
//
//   - doublewrite-readkvstore: etcd decides every global identity
//     (allocation, lookup, release as in kvstore mode); each one this node
//     uses is written to the API server too, with the same ID;
//   - doublewrite-readcrd: the API server decides (as in crd mode); each
//     one this node uses is written to etcd too.
//
// The Backend is a globalstore.Backend over the two stores'
// globalstore.Mirror values. Both stores run whole, each with its cache,
// its record of this node's uses (etcd reference keys on the node's
// lease; the node's IdentityNode) kept from the same globalstore.References,
// its repair of lost records and its garbage collection: each store's
// collector sees this node's use of what it mirrors and keeps it.
//
// The write to the write-only store never fails an allocation: a failure
// is logged, counted and retried by the job doublewrite-retry while the
// node holds the identity. An ID the write-only store gives to another
// label set is never written over: it is logged as an error naming both
// label sets, counted, and turns the module's write-only-store health
// scope degraded (not ready, still live) until it is written or released.
//
// Every --double-write-metric-reporter-interval, the node that collects
// in the read store (or, without collection, every node) compares the two
// stores from its caches and publishes the totals and the IDs in one store
// only, with the names of Cilium operator's reporter. The command
// doublewrite/diff lists the differences on any node.
//
// # Metrics
//
//	identityd_doublewrite_crd_identities              CRD identities (reporting node)
//	identityd_doublewrite_kvstore_identities          etcd identities (reporting node)
//	identityd_doublewrite_crd_only_identities         IDs in the CRDs only (reporting node)
//	identityd_doublewrite_kvstore_only_identities     IDs in etcd only (reporting node)
//	identityd_doublewrite_labels_differ_identities    IDs with different label sets (reporting node)
//	identityd_doublewrite_writes_total{outcome}       written, taken, failed
//	identityd_doublewrite_taken_identities            IDs this node uses taken in the write-only store now
package doublewrite
