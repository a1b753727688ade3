// Package metrics is identityd's Prometheus registry and its HTTP endpoint,
// with the metric definitions the cells share.
//
// # What it provides
//
// Cell provides a *prometheus.Registry owned by the hive (never
// prometheus.DefaultRegisterer, so two hives in one process do not
// interfere), holding the Go and process collectors and every collector
// the cells contribute through the "identityd-metrics" value group:
//
//	cell.Provide(func() metrics.CollectorOut {
//		return metrics.NewCollector(myVec)
//	})
//
// It serves the registry on --prometheus-serve-addr (default
// 127.0.0.1:9981, loopback only; empty disables the endpoint; port 0 picks
// a free port, reported by (*Server).Addr and logged):
//
//   - /metrics: the Prometheus text format.
//   - /healthz (liveness): 200 when every health scope of the hive is OK
//     or Stopped, or Degraded only for a cause outside the agent
//     (health.External, such as an unreachable etcd); 503 otherwise, with
//     one line per scope at fault.
//   - /readyz (readiness): 200 when every health scope is OK or Stopped,
//     503 otherwise, external causes included.
//
// The scopes come from the cells/health provider (optional: without it
// both endpoints only tell that the process is up).
//
// The server listens in its start hook, so an address in use fails the
// start with an error naming the flag, and it is the first hook to start
// and the last to stop: metrics and health are served while the other
// cells start and stop. In a hive with a job registry (job.Cell) and a
// health provider it serves in the job serve-http (health scope
// metrics.job-serve-http), queued right after its hook: the job stops
// accepting connections just before the hook, whose Shutdown lets the
// requests in flight finish until the stop context ends. Without them it
// serves in a goroutine that ends at that Shutdown.
//
// Every cell contributes its own collectors, defined in the metrics.go
// file of its package and provided with NewCollector, in one pattern: a
// ScrapeCollector names the metrics (NewDesc) and reads the values the cell
// keeps (its atomic counters, its tables) at scrape time, and includes the
// vectors the cell records as events happen (the etcd and Kubernetes
// request histograms). The allocator's collector lives in
// internal/identitymetrics, which imports no cell, and implements
// prometheus.Collector itself. This package is the
// bottom of the import graph: it holds the registry, the endpoint and the
// definitions the cells share, and imports no cell, so a hive has exactly
// the metrics of the cells it composes.
//
// # Metrics
//
// All identityd metrics carry the namespace "identityd"; names follow
// Cilium's where Cilium has the metric.
//
// Identities (cells/allocator, read from the Allocator at scrape time):
//
//   - identityd_identity{type} gauge: identities this node knows, by type:
//     reserved, well_known (always 0: identityd has no well-known set),
//     cluster_local (global identities of this cluster's ID range),
//     node_local, remote_node.
//   - identityd_identity_label_sources{source} gauge: identities with at
//     least one label of the source.
//   - identityd_identity_space_usage_ratio{scope} gauge: the fraction of
//     the ID space in use: node_local and remote_node of 2^24-1 IDs each,
//     global of this cluster's range (--cluster-id, --max-connected-clusters).
//     Alert on it well before 1.
//   - identityd_identity_withheld gauge: local IDs withheld for restoration.
//   - identityd_identity_remote_cluster gauge: global identities of other
//     clusters of the mesh, watched read-only.
//   - identityd_identity_restored gauge: identities held only by
//     restoration, released after the grace period unless used again.
//
// Checkpoint (cells/checkpoint, from Checkpoint.Status):
//
//   - identityd_checkpoint_write_duration_seconds gauge: the last
//     successful write (snapshot, encoding, atomic write with fsyncs).
//   - identityd_checkpoint_size_bytes, identityd_checkpoint_entries gauges:
//     the file after that write.
//   - identityd_checkpoint_last_success_timestamp_seconds gauge: start of
//     the last successful write, 0 if none.
//   - identityd_checkpoint_last_write_failed gauge: 1 when the last write
//     failed.
//   - identityd_checkpoint_pending gauge: 1 when a change waits for the
//     next write.
//   - identityd_checkpoint_writes_total, identityd_checkpoint_write_failures_total,
//     identityd_checkpoint_loads_total, identityd_checkpoint_corrupt_files_total,
//     identityd_checkpoint_invalid_entries_total counters.
//
// kvstore (cells/kvstore, from the *kvstore.Client):
//
//   - identityd_kvstore_requests_total{method} counter: etcd requests by
//     gRPC method (Range, Txn, Put, DeleteRange, LeaseGrant, Status, Watch,
//     ...). LeaseGrant counts lease creations, re-creations after a lost
//     lease included. Each scrape adds one Status per endpoint.
//   - identityd_kvstore_connected gauge: 1 when an endpoint answered a
//     status request during the scrape.
//   - identityd_kvstore_endpoints{state} gauge: endpoints connected and
//     unreachable.
//   - identityd_kvstore_lease_held gauge: 1 while this node holds a lease.
//
// Kubernetes client (cells/k8sclient, from the *k8sclient.Client; only
// when the client runs):
//
//   - identityd_k8s_requests_total{verb,resource,code} counter.
//   - identityd_k8s_operations_duration_seconds{verb,resource,outcome}
//     histogram.
//   - identityd_k8s_errors_total{verb,resource,reason} counter.
//   - identityd_k8s_connected gauge.
//
// ipcache (cells/ipcache, from its statedb table):
//
//   - identityd_ipcache_entries gauge: prefixes in the table.
//   - identityd_ipcache_reconciliation_errors gauge: prefixes whose write
//     to the datapath map failed (being retried).
//   - identityd_ipcache_reconciliation_pending gauge: prefixes waiting to
//     be written.
//
// Identity GC (cells/allocator/etcdstore, from the store's counters; only
// with a kvstore):
//
//   - identityd_identity_gc_entries{status} gauge: master keys the GC
//     deleted (status "deleted") and unreferenced candidates it kept
//     because its delete transaction found them referenced or changed
//     ("skipped"), since the agent started. Cilium's gauge of the same name
//     holds the last run's alive and deleted keys; the backend counts
//     totals, not runs, so there is no "alive" series.
//   - identityd_identity_gc_runs{outcome} gauge: GC runs since the agent
//     started that succeeded or failed (a gauge, as in Cilium). A run in
//     progress counts as a success until it fails.
//
// Restoration (cells/restoration, from Restorer.Counters):
//
//   - identityd_identity_restoration{result} gauge: checkpointed
//     identities restored (got their old ID back), skipped (invalid, scope
//     changed, or the allocation failed) and released_after_grace (freed at
//     the end of the grace period because nobody took them up) at this
//     start.
//   - identityd_identity_restoration_prefixes{result} gauge: prefixes of
//     the old datapath map re-created in the ipcache (restored) or refused
//     by it (failed) at this start.
//   - identityd_identity_restoration_skipped_map_entries_total{reason}
//     counter: old datapath map entries skipped at this start because the
//     checkpoint gives their ID to the CIDR label set of another prefix,
//     which the map gives that ID too (shared_id) or not (other_labels).
//
// Shared definitions, created and recorded by the cell that owns the event
// and contributed with NewCollector:
//
//   - identityd_identity_allocation_duration_seconds{scope,outcome}
//     histogram (NewIdentityAllocationDuration): allocation latency, 1µs to
//     4s buckets. Cilium has no such metric.
//   - identityd_kvstore_operations_duration_seconds{scope,kind,action,outcome}
//     histogram (NewKVStoreOperationsDuration), recorded by the kvstore
//     client for every unary etcd request: scope is the first three
//     elements of the key, kind the gRPC service, action the call.
//   - identityd_kvstore_quorum_errors_total{error} counter
//     (NewKVStoreQuorumErrors), recorded by the kvstore client.
//
// NewIdentityGCEntries, NewIdentityGCRuns and NewIdentityRestoration define
// the GC and restoration series for a cell that records them as events
// happen (per GC run, as Cilium does). The identityd agent exports those
// names from the etcdstore and restoration collectors above instead; a
// hive must not register both, as the registry refuses two definitions of
// one name.
//
// Process: the standard go_* and process_* metrics, and promhttp_* for the
// endpoint itself.
package metrics
