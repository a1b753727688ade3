// Package kvstore is the etcd client cell. It knows nothing of identities:
// it connects, keeps this node's data lease, counts and paces requests, and
// reports its state. The allocator's etcd backend builds on it. Of the
// allocator's settings it reads only --identity-allocation-mode: in crd
// mode without --kvstore-endpoints it makes no client at all (below).
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
//     node's keys vanish at once instead of after the TTL. Granted(id)
//     tells whether this client granted id (its last 8 grants): etcd, back
//     after an outage, gives its leases a full TTL anew, so keys on a lease
//     this side took for lost are still this agent's own.
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
// The client tries to reach an etcd that went away at least every
// ReconnectMaxDelay (3s), rather than after gRPC's pause of up to two
// minutes, so that it is back within seconds of etcd's return.
//
// With no --kvstore-endpoints the cell runs an embedded single-member etcd
// with its data in <state-dir>/etcd (needs the statedir cell), logging
// warnings through the agent's logger. It starts in the start hook, bounded
// by the hook's context, and stops in the stop hook after the client is
// closed.
//
// Only the agent's user can reach the embedded etcd. Its client and peer
// listeners are TLS on two free loopback ports picked at each start, and
// both require a client certificate signed by a CA made at that start,
// whose key is never stored. The CA, the server's and the client's
// certificate and key are written to <state-dir>/etcd-tls (0700, files
// 0600) and replaced at every start. Any local user can connect to the
// ports; without those files no one completes a TLS handshake, so no one
// else reads, writes or reconfigures the store. The member record
// advertises the real URLs (the peer URL is rewritten when the ports
// changed), so that etcdctl and kvstore/status show usable addresses.
//
// Unix sockets in the state directory were not used: etcd's embed takes a
// unix peer URL's host only, so a peer socket cannot have an absolute path,
// and socket paths are limited to 108 bytes, which a deep --state-dir
// exceeds. TLS works for both listeners and any state directory path.
//
// At start the client checks within --kvstore-dial-timeout that an endpoint
// answers, so an unreachable etcd fails the start with one line naming the
// endpoints instead of hanging. Before that it makes one TLS handshake with
// each TLS endpoint: when every one fails in a way no retry mends (etcd's
// certificate not signed by --kvstore-ca-file or not naming the endpoint's
// host, this client's certificate refused or missing), the start fails at
// once with an error that names the flag to set.
//
// # crd mode
//
// With --identity-allocation-mode=crd the global identities are
// CiliumIdentity objects in a Kubernetes API server, and nothing in
// identityd needs etcd for them. Without --kvstore-endpoints the cell then
// makes no client (the *Client it provides is nil), starts no embedded etcd,
// creates no <state-dir>/etcd and listens on nothing; it logs why, reports
// health OK, contributes no metrics, and kvstore/status says there is no
// client. The flags are still validated. With endpoints given it connects
// as in kvstore mode.
//
// # Health
//
// The module reports OK once connected, and Degraded when this node's
// lease is lost, until a new one is granted: by the next write that needs
// one, or by the connectivity job once etcd answers. In a hive with a job registry
// (job.Cell) and a health provider, the job etcd-connectivity checks every
// 2s, with a 2s timeout, that etcd answers: a KV or lease request that
// succeeded meanwhile is enough, otherwise it sends one Status request over
// the client's connection. While no endpoint answers, or the member that
// answers knows no leader, its scope is Degraded; OK again at the first
// answer. These reports mark their cause with health.External, so they make
// the agent not ready (/readyz) but not dead (/healthz). While etcd is away
// the job also resets gRPC's reconnection backoff, so that the client tries
// again at every check instead of after up to 2 minutes.
//
// In such a hive the keepalive of the node's lease is the job
// etcd-lease-keepalive (KeepaliveJob): it consumes the keepalive answers,
// says which lease it keeps alive, and marks the lease lost when its
// keepalive ends. It belongs to the client's own run, not to the hive's
// list of hooks: it starts at the end of the client's start hook and stops
// in its stop hook after the client is closed, so the lease is watched
// until its revoke, after every stop hook of the cells that use the
// client, in whatever order the cells are listed. Without a job registry or
// a health provider (or for a Client made with New) the same loop runs in
// a goroutine of the client that ends when it stops.
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
// The TLS and auth flags apply to external endpoints only; setting them
// without --kvstore-endpoints is an error. Flag errors fail the hive in
// the module's own invoke (checkConfig), so hive's "Invoke failed" log
// line names this module, not the first other module that needed the
// client.
//
// # Shell commands
//
//	kvstore/status   summary (mode, node, connected endpoints, leader,
//	                 revision, lease, last error) and one row per endpoint
package kvstore
