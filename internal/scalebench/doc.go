// Package scalebench is the cluster scale benchmark (`make bench-scale`,
// BenchmarkScale in its tests): N simulated nodes, each an agent's hive
// with the allocator and the real store of global identities (the etcd
// store with its own kvstore client, connection, lease and node name; or
// the CRD store with its own API server client and node name), against a
// real etcd and a real Kubernetes API server started as processes
// (internal/etcdtest, internal/k8stest). It counts what reaches the
// servers, at the servers' own /metrics, in a steady window and in a window
// of churn, for N doubling from 8 to 64, and prints the rates by request
// kind, their growth over N, and an extrapolation to 1,000 and 5,000 nodes
// at the default intervals (docs/benchmarks.md, "Cluster scale"). Every
// node keeps every identity in memory, so the benchmark's memory grows as
// N²: about 6 GB at N = 64 in crd mode and N = 128 in etcd mode.
//
// Its settings are environment variables:
//
//	SCALE_NODES        node counts, comma-separated (8,16,32,64,128)
//	SCALE_MODES        stores: etcd, crd or both (etcd,crd)
//	SCALE_IDENTITIES   global identities per node (100)
//	SCALE_SHARED       of these, label sets every node holds (a tenth)
//	SCALE_WINDOW       length of the steady and of the churn window (125s)
//	SCALE_CHURN        changes per second per node in the churn window (0.1)
//	SCALE_GC_INTERVAL  --identity-gc-interval of the nodes (25s)
//	SCALE_WARMUP       churn before the churn window is measured (by mode)
//	SCALE_SAVE         file each run's result is appended to, as a JSON line
//	SCALE_LOAD         saved files (comma-separated): print their rates by N
//	                   and extrapolation again, running nothing
//
// BenchmarkScale runs only with IDENTITYD_BENCH_SCALE=1, which the make
// target sets. The package has no code outside its tests.
package scalebench
