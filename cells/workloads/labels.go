package workloads

import (
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/identityd/identityd/labels"
)

// The keys Cilium derives for a pod.
const (
	// CiliumLabelPrefix starts the keys Cilium sets itself; a pod's own
	// labels with it are dropped.
	CiliumLabelPrefix = "io.cilium.k8s"
	// NamespaceLabelsPrefix starts the key of each namespace label.
	NamespaceLabelsPrefix = CiliumLabelPrefix + ".namespace.labels."
	// PodNamespaceLabel holds the namespace's name.
	PodNamespaceLabel = "io.kubernetes.pod.namespace"
	// ServiceAccountLabel holds the pod's service account.
	ServiceAccountLabel = CiliumLabelPrefix + ".policy.serviceaccount"
	// ClusterLabel holds the cluster's name.
	ClusterLabel = CiliumLabelPrefix + ".policy.cluster"
)

// PodLabels returns the labels of pod in namespace ns in cluster before
// filtering (see the package doc), sorted, or an error naming the label
// that identityd cannot keep (a control character, say: the API server
// lets none through).
func PodLabels(pod *corev1.Pod, ns *corev1.Namespace, cluster string) (labels.Labels, error) {
	kv := make(map[string]string, len(pod.Labels)+len(ns.Labels)+3)
	for k, v := range pod.Labels {
		if !strings.HasPrefix(k, CiliumLabelPrefix) {
			kv[k] = v
		}
	}
	for k, v := range ns.Labels {
		kv[NamespaceLabelsPrefix+k] = v
	}
	kv[PodNamespaceLabel] = ns.Name
	if sa := pod.Spec.ServiceAccountName; sa != "" {
		kv[ServiceAccountLabel] = sa
	}
	kv[ClusterLabel] = cluster

	byKey := make(map[string]labels.Label, len(kv))
	for k, v := range kv {
		key, value, rewritten := ciliumKey(k, v)
		if _, taken := byKey[key]; taken && rewritten {
			continue // the label written with this key wins
		}
		byKey[key] = labels.Label{Source: labels.SourceK8s, Key: key, Value: value}
	}
	out := make([]labels.Label, 0, len(byKey))
	for _, l := range byKey {
		out = append(out, l)
	}
	ls, err := labels.New(out...)
	if err != nil {
		return nil, fmt.Errorf("pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	return ls, nil
}

// reservedKeyPrefix is the prefix Cilium's label constructor reads as the
// reserved source in a key without ':'.
const reservedKeyPrefix = labels.SourceReserved + "."

// ciliumKey is the key and value Cilium's label constructor makes of a
// map entry given the source k8s: a source written into the key is
// dropped. rewritten says the key changed.
func ciliumKey(k, v string) (key, value string, rewritten bool) {
	reserved := false
	switch i := strings.IndexByte(k, ':'); {
	case k == "":
		return k, v, false
	case k[0] == '$':
		key, reserved = k[1:], true
	case i >= 0:
		key, reserved = k[i+1:], k[:i] == labels.SourceReserved
	case strings.HasPrefix(k, reservedKeyPrefix):
		key, reserved = k[len(reservedKeyPrefix):], true
	default:
		return k, v, false
	}
	if reserved && key == "" {
		return v, "", true
	}
	return key, v, true
}

// PodIdentityLabels returns the identity labels of pod in namespace ns in
// cluster: PodLabels, filtered by f.
func (f *LabelFilter) PodIdentityLabels(pod *corev1.Pod, ns *corev1.Namespace, cluster string) (labels.Labels, error) {
	all, err := PodLabels(pod, ns, cluster)
	if err != nil {
		return nil, err
	}
	ids, _ := f.Filter(all)
	return ids, nil
}
