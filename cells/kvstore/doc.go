// Package kvstore is the etcd client cell. It knows nothing of identities:
// it connects, keeps this node's data lease, counts and paces requests, and
// reports its state. The allocator's etcd backend builds on it.
//
// # What it provides
//
// Cell provides *Client:
//
//   - Client() is the raw *clientv3.Client for transactions, reads and
//     watches. Every RPC made through it is counted by method
//     (RequestCounts) and KV RPCs are paced by --kvstore-rate-limit.
//   - Lease(ctx) returns this node's data lease, granted lazily with
//     --kvstore-lease-ttl and kept alive. LeaseLost(id) is closed when that
//     lease is lost (expired, revoked by someone else, or refused by etcd),
//     after which Lease grants a new one and the keys written with the old
//     one must be written again. The lease is revoked on stop, so this
//     node's keys vanish at once instead of after the TTL.
//   - Status(ctx) reports mode, endpoints, leader, revision, lease and the
//     last request error.
//   - RequestContext(ctx) bounds one request by --kvstore-request-timeout
//     and by the stop path's deadline; StopContext(ctx) gives the stop
//     path's work that deadline, fixed by its first call StopBudget (3s)
//     ahead, so that a stop with etcd gone takes seconds, not a request
//     timeout per call; Stopping() is closed when the stop begins (a
//     pre-stop hook, before any cell's stop hook), after which keys on the
//     node's lease need no per-key delete: the revoke, or the TTL if etcd
//     is gone, removes them.
//
// With no --kvstore-endpoints the cell runs an embedded single-member etcd
// with its data in <state-dir>/etcd (needs the statedir cell), listening on
// loopback ports chosen by the kernel, and logging warnings through the
// agent's logger. It starts in the start hook, bounded by the hook's
// context, and stops in the stop hook after the client is closed.
//
// At start the client checks within --kvstore-dial-timeout that an endpoint
// answers, so an unreachable etcd fails the start with one line naming the
// endpoints instead of hanging.
//
// # Flags
//
//	--kvstore-endpoints        etcd client URLs; empty: embedded etcd
//	--kvstore-ca-file          CA bundle verifying the servers
//	--kvstore-cert-file        client certificate (with --kvstore-key-file)
//	--kvstore-key-file         client key
//	--kvstore-username         etcd user (with --kvstore-password-file)
//	--kvstore-password-file    file holding the user's password
//	--kvstore-lease-ttl        node lease TTL, 25s..24h (default 15m)
//	--kvstore-dial-timeout     time to reach etcd at start (default 15s)
//	--kvstore-request-timeout  timeout of one request (default 30s)
//	--kvstore-rate-limit       KV requests per second, 0 = unlimited (default 0)
//	--node-name                this node's key suffix (default: host name)
//
// TLS and auth apply to external endpoints only; setting them without
// --kvstore-endpoints is an error.
//
// # Shell commands
//
//	kvstore/status   summary (mode, node, connected endpoints, leader,
//	                 revision, lease, last error) and one row per endpoint
package kvstore
