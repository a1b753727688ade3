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
// target sets.
//
// BenchmarkRelabelStorm (`make bench-relabel`) is the relabel storm of a
// cluster (docs/benchmarks.md, "Relabel storm"): N simulated nodes, each a
// hive with the allocator, the store (the CRD store; in etcd mode the etcd
// store, on an etcd of its own), the ipcache and the workloads cell, with
// its own Kubernetes client (a client certificate of its own, hence its
// own connections) and node name, against a real kube-apiserver. Pods are
// created bound to the nodes (spec.nodeName) with their IPs written
// through the status subresource; the pods of a deployment share their
// labels, and so their identity, across nodes. Once every pod holds its
// identity, a label of the namespace holding half of the pods changes, and
// each of its pods needs the identity of its new labels. It measures the
// time until every pod of that namespace is on its new identity on its
// node, counts the requests and watch events at the servers' /metrics
// from the relabel until the grace period after it, the CiliumIdentity
// WATCH requests of the run in crd mode (the API server counts a watch
// when it ends, an open one in apiserver_longrunning_requests: their sum),
// the identities whose labels another one has, and the label sets the
// nodes hold under more than one identity; the last three fail the run
// when above nodes+20, 0 and 0. Its settings are environment variables:
//
//	RELABEL_MODES        stores: crd, etcd or both (crd)
//	RELABEL_MANAGEMENT   the nodes' --identity-management-mode: agent, or
//	                     operator with one identity manager (agent)
//	RELABEL_NODES        node counts, comma-separated (8,16,32,64)
//	RELABEL_PODS         pods, half in the relabelled namespace (20000)
//	RELABEL_NAMESPACES   namespaces, the relabelled one included (4)
//	RELABEL_DEPLOYMENTS  label sets per namespace (50)
//	RELABEL_GRACE        --identity-change-grace-period of the nodes
//	                     (the cell's default)
//	RELABEL_TIMEOUT      bound of the setup and of the storm, each (1h)
//
// It runs only with IDENTITYD_BENCH_RELABEL=1, which its make target sets;
// TestRelabelStormSmoke runs it in both stores, and in crd mode with
// operator-managed identities too, with two nodes and a few pods. The package has no code outside its tests.
package scalebench
