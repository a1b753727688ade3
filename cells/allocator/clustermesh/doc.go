// Package clustermesh follows the global identities of other clusters of a
// mesh, read-only, as the allocator's globalstore.Remote.
//
// One file per remote cluster in --clustermesh-config, named after the
// cluster, in the YAML format of RemoteClusterConfig (endpoints,
// cluster-id, ca-file, cert-file, key-file, username, password-file). Each
// remote cluster's master keys are listed and watched in its own etcd
// (etcdstore.Follower); an entry whose ID is outside that cluster's range
// (with this node's --max-connected-clusters) or whose labels lack
// k8s:io.cilium.k8s.policy.cluster=<name> is logged, counted and ignored.
// Accepted identities are found by the allocator's LookupByID and
// LookupByLabels, listed with source "remote", and published to Observe and
// identity handlers. Removing a file, or a cluster unreachable for
// --clustermesh-remote-timeout, deletes all its identities; a reconnect
// lists again and reports only the differences. Status, clustermesh/status
// and the identityd_clustermesh_remote_cluster_* metrics show each
// cluster's state.
//
// # Flags
//
//	--clustermesh-config           directory of remote cluster files, polled every second ("": none)
//	--clustermesh-remote-timeout   unreachable time after which a remote cluster's identities are withdrawn (5m)
//
// # Shell commands
//
//	clustermesh/status [-o table|json|yaml]
package clustermesh
