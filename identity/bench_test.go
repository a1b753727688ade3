package identity

import (
	"testing"

	"github.com/identityd/identityd/labels"
)

// BenchmarkReservedLookup measures the reserved lookup every allocation
// starts with, for a pod's label set (not reserved) and a CIDR set, with
// and without the well-known identities.
func BenchmarkReservedLookup(b *testing.B) {
	pod := labels.MustParse("k8s:app=web", "k8s:io.kubernetes.pod.namespace=default",
		"k8s:io.cilium.k8s.policy.cluster=default", "k8s:io.cilium.k8s.policy.serviceaccount=web",
		"k8s:io.cilium.k8s.namespace.labels.kubernetes.io/metadata.name=default", "k8s:pod-template-hash=abc")
	cidr := labels.MustParse("cidr:10.0.0.0/8", "reserved:world")
	for _, wk := range []bool{false, true} {
		r := NewReservedResolver(ReservedConfig{WellKnown: wk, ClusterName: "default", CiliumNamespace: DefaultCiliumNamespace})
		for name, ls := range map[string]labels.Labels{"pod": pod, "cidr": cidr} {
			b.Run(name+map[bool]string{false: "/well-known-off", true: "/well-known-on"}[wk], func(b *testing.B) {
				for b.Loop() {
					if r.LookupByLabels(ls) != nil {
						b.Fatal("reserved")
					}
				}
			})
		}
	}
}
