package crdstore

import (
	"maps"
	"strings"
	"testing"

	metav1validation "k8s.io/apimachinery/pkg/apis/meta/v1/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// hostileLabels are label sets that are valid in etcd mode and that Cilium
// would copy into metadata.labels unchecked, so that the API server refuses
// the object.
func hostileLabels(t testing.TB) []labels.Labels {
	t.Helper()
	long := strings.Repeat("v", 5000)
	var out []labels.Labels
	for _, strs := range [][]string{
		{"k8s:app=a=b", "k8s:io.kubernetes.pod.namespace=prod"},
		{"k8s:$key=value", "k8s:ok=fine"},
		{"k8s:with#hash=x", "k8s:sp ace=in key"},
		{"k8s:value=has spaces in it"},
		{"k8s:long=" + long, "k8s:" + strings.Repeat("k", 300) + "=x"},
		{"k8s:io.cilium.k8s.namespace.labels.team=a", "k8s:app=web", "container:id=c1"},
	} {
		out = append(out, labels.MustParse(strs...))
	}
	return out
}

func TestObjectLabelsAreValidKubernetesLabels(t *testing.T) {
	for _, lbls := range hostileLabels(t) {
		sel, _ := objectLabels(lbls)
		if errs := metav1validation.ValidateLabels(sel, field.NewPath("metadata", "labels")); len(errs) > 0 {
			t.Errorf("%s: metadata.labels %v refused: %v", lbls, sel, errs.ToAggregate())
		}
		// Every label stays in security-labels.
		back, err := parseSecurityLabels(securityLabels(lbls))
		if err != nil || !back.Equal(lbls) {
			t.Errorf("%s: security-labels read back as %s, %v", lbls, back, err)
		}
	}
}

func TestObjectLabelsSelectLikeCilium(t *testing.T) {
	lbls := labels.MustParse("k8s:app=web", "k8s:io.kubernetes.pod.namespace=prod",
		"k8s:io.cilium.k8s.namespace.labels.team=a", "container:id=c1", "k8s:bad=a=b", "reserved:host")
	sel, skipped := objectLabels(lbls)
	want := map[string]string{"app": "web", "io.kubernetes.pod.namespace": "prod"}
	if !maps.Equal(sel, want) || skipped != 1 {
		t.Errorf("objectLabels = %v, %d skipped; want %v, 1", sel, skipped, want)
	}
}

func TestParseSecurityLabelsRefusesBadMaps(t *testing.T) {
	for _, m := range []map[string]string{
		{"nosource": "x"},
		{":key": "x"},
		{"k8s:": "x"},
		{"k8s:a;b": "x"},
	} {
		if l, err := parseSecurityLabels(m); err == nil {
			t.Errorf("parseSecurityLabels(%v) = %s, want an error", m, l)
		}
	}
}

func TestProbeCoversTheRange(t *testing.T) {
	for _, cluster := range []identity.ClusterInfo{
		{Name: "default"},
		{ID: 7, Name: "c7"},
		{ID: 511, Name: "c511", MaxConnectedClusters: 511},
	} {
		p := newProbe("k8s:app=web;", cluster)
		if p.n != uint64(cluster.MaxID()-cluster.MinID())+1 {
			t.Fatalf("%+v: n = %d", cluster, p.n)
		}
		seen := make(map[identity.NumericIdentity]bool, p.n)
		for i := range p.n {
			id := p.slot(i)
			if id < cluster.MinID() || id > cluster.MaxID() || seen[id] {
				t.Fatalf("%+v: slot(%d) = %d, out of range or repeated", cluster, i, id)
			}
			seen[id] = true
			if pos, ok := p.position(id); !ok || pos != i {
				t.Fatalf("%+v: position(slot(%d)) = %d, %v", cluster, i, pos, ok)
			}
		}
		if _, ok := p.position(cluster.MaxID() + 1); ok {
			t.Errorf("%+v: an ID past the range has a position", cluster)
		}
	}
}

// TestProbeStartIsFixed pins the first slot of a label set: it is part of
// the format, shared by every node (docs/crd-store.md).
func TestProbeStartIsFixed(t *testing.T) {
	p := newProbe("k8s:app=web;k8s:io.kubernetes.pod.namespace=prod;", identity.ClusterInfo{Name: "default"})
	// SHA-256 of the string, first 8 bytes big-endian, mod 65280, + 256.
	if got := p.slot(0); got != 52321 {
		t.Errorf("slot(0) = %d, want 52321", got)
	}
}

func TestParseName(t *testing.T) {
	for name, ok := range map[string]bool{"256": true, "65535": true, "0256": false, "-1": false, "+5": false, "": false, "1e3": false, "4294967296": false, "abc": false} {
		if _, err := parseName(name); (err == nil) != ok {
			t.Errorf("parseName(%q): %v", name, err)
		}
	}
}

func TestOlderVersion(t *testing.T) {
	for _, tc := range []struct {
		have string
		old  bool
	}{{"", true}, {"x", true}, {"1.29.12", true}, {"1.29.13", false}, {"1.30.0", false}, {"1.29", true}, {"2", false}} {
		if got := olderVersion(tc.have, "1.29.13"); got != tc.old {
			t.Errorf("olderVersion(%q) = %v", tc.have, got)
		}
	}
}
