package workloads

import (
	"fmt"
	"net/netip"
	"slices"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/identityd/identityd/labels"
)

// reason says why a pod holds no identity of its own.
type reason string

const (
	reasonNone        reason = ""
	reasonGone        reason = "deleted"
	reasonTerminal    reason = "terminated"
	reasonHostNetwork reason = "host network"
	reasonOtherNode   reason = "on another node"
	reasonNoNamespace reason = "waiting for its namespace"
	reasonBadLabels   reason = "labels refused"
)

// want is what a pod should hold: an identity for labels and its IPs in the
// ipcache, or nothing (skip says why). A pod waiting for its namespace keeps
// what it holds.
type want struct {
	skip     reason
	labels   labels.Labels
	prefixes []netip.Prefix
	// problem is what was refused in the pod's input (a label, an IP),
	// for the log; the rest of the pod is used.
	problem error
}

// needsIdentity says the pod should hold an identity (it may not yet).
func (w want) needsIdentity() bool { return w.skip == reasonNone || w.skip == reasonNoNamespace }

// decide is what pod (nil: deleted) in ns (nil: not seen yet) on node
// should hold.
func decide(pod *corev1.Pod, ns *corev1.Namespace, node, cluster string, f *LabelFilter) want {
	switch {
	case pod == nil:
		return want{skip: reasonGone}
	case pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed:
		return want{skip: reasonTerminal}
	case pod.Spec.HostNetwork:
		// The pod uses the node's addresses, which have the host's
		// identity; it has none of its own.
		return want{skip: reasonHostNetwork}
	case node != "" && pod.Spec.NodeName != node:
		// The field selector keeps other nodes' pods out; a pod read
		// otherwise is not this node's to serve. The manager (no node)
		// serves every pod.
		return want{skip: reasonOtherNode}
	case ns == nil:
		return want{skip: reasonNoNamespace}
	}
	lbls, err := f.PodIdentityLabels(pod, ns, cluster)
	if err != nil {
		return want{skip: reasonBadLabels, problem: err}
	}
	prefixes, err := podPrefixes(pod)
	return want{labels: lbls, prefixes: prefixes, problem: err}
}

// podPrefixes returns the pod's IPs (status.podIPs, else status.podIP) as
// host prefixes, sorted and without duplicates, and an error naming the
// addresses that are not IPs (which are left out).
func podPrefixes(pod *corev1.Pod) ([]netip.Prefix, error) {
	ips := make([]string, 0, len(pod.Status.PodIPs)+1)
	for _, ip := range pod.Status.PodIPs {
		ips = append(ips, ip.IP)
	}
	if len(ips) == 0 && pod.Status.PodIP != "" {
		ips = append(ips, pod.Status.PodIP)
	}
	var (
		out []netip.Prefix
		bad []string
	)
	for _, s := range ips {
		addr, err := netip.ParseAddr(s)
		if err != nil || addr.Zone() != "" || addr.IsUnspecified() {
			bad = append(bad, s)
			continue
		}
		addr = addr.Unmap()
		out = append(out, netip.PrefixFrom(addr, addr.BitLen()))
	}
	slices.SortFunc(out, comparePrefix)
	out = slices.Compact(out)
	if len(bad) > 0 {
		return out, fmt.Errorf("pod %s/%s: status.podIPs %q are not IP addresses", pod.Namespace, pod.Name, bad)
	}
	return out, nil
}

func comparePrefix(a, b netip.Prefix) int {
	if c := a.Addr().Compare(b.Addr()); c != 0 {
		return c
	}
	return a.Bits() - b.Bits()
}

// prefixDiff returns the prefixes of next that cur lacks and those of cur
// that next lacks; both inputs sorted.
func prefixDiff(cur, next []netip.Prefix) (add, remove []netip.Prefix) {
	for _, p := range next {
		if _, ok := slices.BinarySearchFunc(cur, p, comparePrefix); !ok {
			add = append(add, p)
		}
	}
	for _, p := range cur {
		if _, ok := slices.BinarySearchFunc(next, p, comparePrefix); !ok {
			remove = append(remove, p)
		}
	}
	return add, remove
}

// slimPod keeps of a pod what decide reads, so that the informer's copy
// of every pod of the node costs little (no managed fields, annotations,
// containers or conditions). Other objects pass as they are.
func slimPod(obj any) (any, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: p.Name, Namespace: p.Namespace, UID: p.UID, ResourceVersion: p.ResourceVersion, Labels: p.Labels,
		},
		Spec:   corev1.PodSpec{NodeName: p.Spec.NodeName, HostNetwork: p.Spec.HostNetwork, ServiceAccountName: p.Spec.ServiceAccountName},
		Status: corev1.PodStatus{Phase: p.Status.Phase, PodIP: p.Status.PodIP, PodIPs: p.Status.PodIPs},
	}, nil
}

// slimNamespace keeps of a namespace its name and labels.
func slimNamespace(obj any) (any, error) {
	ns, ok := obj.(*corev1.Namespace)
	if !ok {
		return obj, nil
	}
	return &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{
		Name: ns.Name, UID: ns.UID, ResourceVersion: ns.ResourceVersion, Labels: ns.Labels,
	}}, nil
}
