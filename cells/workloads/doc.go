// Package workloads gives the pods of a node their security identities:
// it turns a Kubernetes Pod and its Namespace into the security labels of
// the pod's identity, exactly as Cilium v1.16's agent does, so that
// identityd and Cilium agents give one pod one identity, allocates that
// identity and puts the pod's IPs into the ipcache with it.
//
// # The cell
//
// Cell provides *Workloads when the hive has a Kubernetes client
// (*k8sclient.Client: crd mode, or --k8s-kubeconfig-path or
// --k8s-api-server set); without one it provides nil, logs once that pods
// get no identities from this node, and starts nothing. It depends on
// allocator.Allocator, *ipcache.IPCache, identity.ClusterInfo (the cluster
// name label), identity.NodeName (--node-name), job and health.
//
// With --identity-management-mode=agent (Cilium's default) or both each
// node serves its own pods:
// a job lists and watches the pods whose spec.nodeName is this node (a
// field selector: no node reads another node's pods) and all namespaces.
// Once both are listed, for each pod:
//
//   - its identity labels are PodIdentityLabels of the pod and its
//     namespace, with --label-prefix-file and --labels; a pod whose
//     namespace is not known yet waits for it, keeping what it holds;
//   - it holds one allocator reference on the identity of those labels,
//     allocated for all changed pods of a pass in one batch; a failed
//     allocation is counted and retried with a jittered backoff that grows
//     to about a minute, and the pod keeps its previous identity meanwhile;
//   - with --identity-management-mode=operator the node creates no global
//     identity: an identity manager does, and the pod adopts it
//     (allocator.AdoptOnly). While the store's cache shows none the pod
//     waits, costing no request, and tries again every second; that is
//     not a failure. A pod that waits longer than
//     --identity-allocation-timeout is reported once: an error line,
//     identityd_workloads_identity_not_created_total, and the count in the
//     job's health message. The manager is ManagerCell (`identityd
//     manager`). The cell provides globalstore.AdoptOnly, so that the
//     stores write no global identity either (no mark removed, none
//     re-created): a node in operator mode needs only read access to them;
//   - its IPs (status.podIPs, else status.podIP) are ipcache rows of the
//     owner "pod/<namespace>/<name>", /32 and /128, with the identity given
//     directly; an IP that leaves the pod leaves the ipcache, and an IP
//     that is not an address is logged and left out;
//   - when its labels (or its namespace's) change, the identity of the new
//     labels is allocated, the rows get its number, and the old identity
//     is released after --identity-change-grace-period; when the pod is
//     deleted or ends (Succeeded, Failed), its rows leave the ipcache at
//     once and its identity is released after the same grace period;
//   - a host-network pod (spec.hostNetwork) uses the node's addresses and
//     gets no identity and no row of its own.
//
// The cell registers an ipcache initializer in its constructor and marks
// it done once every pod of the first listing holds its identity (or after
// a bound, so that a store that is away does not keep stale entries
// forever): the ipcache prunes nothing of the datapath map before, so a
// restarted agent keeps every pod's entry, and allocates each pod's label
// set again, which the store answers with the identity it already has.
// Nothing is released before the first listing, and nothing on stop.
//
// # Health
//
// The module's health says what the job does (listing, serving) and, after
// a failed listing or watch, which one failed and why; client-go retries
// it with its backoff. It stays OK: the node serves its other identities
// all the same, so readiness does not depend on the pods being listed.
// Each failed allocation and each failed ipcache write is logged.
//
// # Flags
//
//	--identity-management-mode=MODE        who creates pods' identities:
//	                                       agent (default), operator, both
//	--identity-change-grace-period=DURATION how long an old identity is held
//	                                       after a relabel or a deletion
//	                                       (default 5s, Cilium's)
//	--label-prefix-file=PATH               Cilium's label prefix file
//	--labels=PREFIX,...                    label prefixes added
//
// # Shell commands
//
//	workloads/list [namespace] [-o table|json|yaml]
//
// lists the node's pods: name, IPs, identity, state (ready, allocating,
// allocation failed N times, waiting for its namespace, host network,
// terminated) and identity labels.
//
// # Metrics
//
//	identityd_workloads_pods_without_identity       gauge
//	identityd_workloads_identity_wait_seconds       histogram
//	identityd_workloads_allocation_failures_total   counter
//
// # Labels
//
// PodLabels builds the labels of a pod before filtering, all of source k8s:
//
//   - the pod's own labels, but those whose key starts with io.cilium.k8s
//     (Cilium sets those itself; a pod may not claim them);
//   - each label of the namespace as io.cilium.k8s.namespace.labels.<key>;
//   - io.kubernetes.pod.namespace=<namespace name>;
//   - io.cilium.k8s.policy.serviceaccount=<spec.serviceAccountName>, when set;
//   - io.cilium.k8s.policy.cluster=<cluster name>, always.
//
// A key is read as Cilium's label constructor reads it: a source prefix
// written into the key (before ':' or a leading '$', or "reserved.") is
// dropped, the source stays k8s. Valid Kubernetes keys hold neither ':'
// nor '$'; "reserved.foo" is valid and becomes k8s:foo. Should that meet a
// label foo of the pod, Cilium keeps either one (map order); PodLabels
// keeps foo.
//
// A LabelFilter then splits the labels into identity labels and
// information labels with Cilium's rules: the default prefix list, or
// --label-prefix-file's, extended by --labels (see NewLabelFilter).
// PodIdentityLabels does both steps.
//
// Named ports are not identity labels in Cilium v1.16's agent: they are
// kept beside the identity, not in its labels.
package workloads
