// Package workloads turns a Kubernetes Pod and its Namespace into the
// security labels of the pod's identity, exactly as Cilium v1.16's agent
// does, so that identityd and Cilium agents give one pod one identity.
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
