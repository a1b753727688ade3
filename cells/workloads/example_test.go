package workloads_test

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/identityd/identityd/cells/workloads"
)

// A Deployment's pod: the pod-template-hash differs from one rollout to
// the next and is no identity label; the namespace's labels are.
func ExampleLabelFilter_PodIdentityLabels() {
	filter, err := workloads.NewLabelFilter(nil, nil) // Cilium's default list
	if err != nil {
		panic(err)
	}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{"team": "web"}}}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "web-5d4f8c9b7-x2x7k", Namespace: "shop",
			Labels: map[string]string{"app": "web", "pod-template-hash": "5d4f8c9b7"}},
		Spec: corev1.PodSpec{ServiceAccountName: "web"},
	}
	ids, err := filter.PodIdentityLabels(pod, ns, "default")
	if err != nil {
		panic(err)
	}
	for _, l := range ids {
		fmt.Println(l)
	}
	// Output:
	// k8s:app=web
	// k8s:io.cilium.k8s.namespace.labels.team=web
	// k8s:io.cilium.k8s.policy.cluster=default
	// k8s:io.cilium.k8s.policy.serviceaccount=web
	// k8s:io.kubernetes.pod.namespace=shop
}
