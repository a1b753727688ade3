package workloads

import (
	"net/netip"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// testPod is a running pod on node n1 in namespace ns with labels and IPs.
func testPod(name string, lbls map[string]string, ips ...string) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", Labels: lbls},
		Spec:       corev1.PodSpec{NodeName: "n1", ServiceAccountName: "sa"},
		Status:     corev1.PodStatus{Phase: corev1.PodRunning},
	}
	for _, ip := range ips {
		p.Status.PodIPs = append(p.Status.PodIPs, corev1.PodIP{IP: ip})
	}
	return p
}

func testNamespace(name string, lbls map[string]string) *corev1.Namespace {
	return &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: lbls}}
}

func TestDecide(t *testing.T) {
	f, err := NewLabelFilter(nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ns := testNamespace("ns", map[string]string{"team": "a"})
	running := testPod("p", map[string]string{"app": "web", "pod-template-hash": "abc"}, "10.0.0.1", "fd00::1")
	with := func(mod func(p *corev1.Pod)) *corev1.Pod {
		p := running.DeepCopy()
		mod(p)
		return p
	}
	for _, tc := range []struct {
		name     string
		pod      *corev1.Pod
		ns       *corev1.Namespace
		skip     reason
		labels   []string
		prefixes []string
		problem  string
	}{
		{name: "deleted", pod: nil, ns: ns, skip: reasonGone},
		{name: "succeeded", pod: with(func(p *corev1.Pod) { p.Status.Phase = corev1.PodSucceeded }), ns: ns, skip: reasonTerminal},
		{name: "failed", pod: with(func(p *corev1.Pod) { p.Status.Phase = corev1.PodFailed }), ns: ns, skip: reasonTerminal},
		{name: "host network", pod: with(func(p *corev1.Pod) { p.Spec.HostNetwork = true }), ns: ns, skip: reasonHostNetwork},
		{name: "other node", pod: with(func(p *corev1.Pod) { p.Spec.NodeName = "n2" }), ns: ns, skip: reasonOtherNode},
		{name: "namespace not seen", pod: running, ns: nil, skip: reasonNoNamespace},
		{
			name: "running", pod: running, ns: ns,
			labels: []string{"k8s:app=web", "k8s:io.cilium.k8s.namespace.labels.team=a", "k8s:io.cilium.k8s.policy.cluster=c1",
				"k8s:io.cilium.k8s.policy.serviceaccount=sa", "k8s:io.kubernetes.pod.namespace=ns"},
			prefixes: []string{"10.0.0.1/32", "fd00::1/128"},
		},
		{
			name: "pending, no IP yet", pod: with(func(p *corev1.Pod) { p.Status = corev1.PodStatus{Phase: corev1.PodPending} }), ns: ns,
			labels: []string{"k8s:app=web", "k8s:io.cilium.k8s.namespace.labels.team=a", "k8s:io.cilium.k8s.policy.cluster=c1",
				"k8s:io.cilium.k8s.policy.serviceaccount=sa", "k8s:io.kubernetes.pod.namespace=ns"},
		},
		{
			name: "podIP alone, IPv4-mapped", pod: with(func(p *corev1.Pod) { p.Status.PodIPs, p.Status.PodIP = nil, "::ffff:10.0.0.2" }), ns: ns,
			labels: []string{"k8s:app=web", "k8s:io.cilium.k8s.namespace.labels.team=a", "k8s:io.cilium.k8s.policy.cluster=c1",
				"k8s:io.cilium.k8s.policy.serviceaccount=sa", "k8s:io.kubernetes.pod.namespace=ns"},
			prefixes: []string{"10.0.0.2/32"},
		},
		{
			name: "odd IPs left out", pod: with(func(p *corev1.Pod) {
				p.Status.PodIPs = []corev1.PodIP{{IP: "10.0.0.3"}, {IP: "nonsense"}, {IP: "fe80::1%eth0"}, {IP: "0.0.0.0"}, {IP: "10.0.0.3"}, {IP: ""}}
			}), ns: ns,
			labels: []string{"k8s:app=web", "k8s:io.cilium.k8s.namespace.labels.team=a", "k8s:io.cilium.k8s.policy.cluster=c1",
				"k8s:io.cilium.k8s.policy.serviceaccount=sa", "k8s:io.kubernetes.pod.namespace=ns"},
			prefixes: []string{"10.0.0.3/32"},
			problem:  "nonsense",
		},
		{
			name: "label refused", pod: with(func(p *corev1.Pod) { p.Labels = map[string]string{"app": "a\x01b"} }), ns: ns,
			skip: reasonBadLabels, problem: "p",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := decide(tc.pod, tc.ns, "n1", "c1", f)
			// What the informers keep decides the same.
			pod, ns := tc.pod, tc.ns
			if pod != nil {
				slim, _ := slimPod(pod.DeepCopy())
				pod = slim.(*corev1.Pod)
			}
			if ns != nil {
				slim, _ := slimNamespace(ns.DeepCopy())
				ns = slim.(*corev1.Namespace)
			}
			if sw := decide(pod, ns, "n1", "c1", f); sw.skip != w.skip || !sw.labels.Equal(w.labels) || !slices.Equal(sw.prefixes, w.prefixes) {
				t.Errorf("on the informers' copy: %+v, on the pod: %+v", sw, w)
			}
			if w.skip != tc.skip {
				t.Fatalf("skip %q, want %q", w.skip, tc.skip)
			}
			if got := w.labels.Strings(); !slices.Equal(got, tc.labels) {
				t.Errorf("labels %q, want %q", got, tc.labels)
			}
			var got []string
			for _, p := range w.prefixes {
				got = append(got, p.String())
			}
			if !slices.Equal(got, tc.prefixes) {
				t.Errorf("prefixes %q, want %q", got, tc.prefixes)
			}
			switch {
			case tc.problem == "" && w.problem != nil:
				t.Errorf("problem %v, want none", w.problem)
			case tc.problem != "" && (w.problem == nil || !strings.Contains(w.problem.Error(), tc.problem)):
				t.Errorf("problem %v, want one naming %q", w.problem, tc.problem)
			}
		})
	}
}

func TestPrefixDiff(t *testing.T) {
	p := netip.MustParsePrefix
	cur := []netip.Prefix{p("10.0.0.1/32"), p("10.0.0.2/32"), p("fd00::1/128")}
	next := []netip.Prefix{p("10.0.0.2/32"), p("10.0.0.3/32"), p("fd00::1/128")}
	add, remove := prefixDiff(cur, next)
	if !slices.Equal(add, []netip.Prefix{p("10.0.0.3/32")}) || !slices.Equal(remove, []netip.Prefix{p("10.0.0.1/32")}) {
		t.Fatalf("add %v remove %v", add, remove)
	}
	if add, remove := prefixDiff(nil, cur); !slices.Equal(add, cur) || remove != nil {
		t.Fatalf("from nothing: add %v remove %v", add, remove)
	}
}

// FuzzDecide: no pod or namespace input makes decide panic, and what it
// keeps is sane: identity labels only when it serves the pod, host
// prefixes only, sorted and unique.
func FuzzDecide(f *testing.F) {
	f.Add("app", "web", "team", "a", "10.0.0.1", "fd00::1", false, "Running")
	f.Add("reserved:host", "", "$x", "y", "::ffff:1.2.3.4", "fe80::1%eth0", false, "Pending")
	f.Add("io.cilium.k8s.policy.cluster", "other", "", "", "nonsense", "", true, "Succeeded")
	filter, err := NewLabelFilter(nil, nil)
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, podKey, podValue, nsKey, nsValue, ip1, ip2 string, hostNetwork bool, phase string) {
		pod := testPod("p", map[string]string{podKey: podValue}, ip1, ip2)
		pod.Spec.HostNetwork = hostNetwork
		pod.Status.Phase = corev1.PodPhase(phase)
		pod.Status.PodIP = ip2
		ns := testNamespace("ns", map[string]string{nsKey: nsValue})
		w := decide(pod, ns, "n1", "c1", filter)
		if w.skip != reasonNone && (len(w.labels) > 0 || len(w.prefixes) > 0) {
			t.Fatalf("skipped pod (%s) keeps labels %v prefixes %v", w.skip, w.labels, w.prefixes)
		}
		for i, p := range w.prefixes {
			if !p.IsValid() || p.Bits() != p.Addr().BitLen() || p.Addr().Is4In6() || p.Addr().Zone() != "" {
				t.Fatalf("prefix %v is not a host prefix", p)
			}
			if i > 0 && comparePrefix(w.prefixes[i-1], p) >= 0 {
				t.Fatalf("prefixes %v not sorted and unique", w.prefixes)
			}
		}
		if w.skip == reasonNone {
			if err := w.labels.Validate(); err != nil {
				t.Fatalf("labels %v: %v", w.labels, err)
			}
		}
	})
}
