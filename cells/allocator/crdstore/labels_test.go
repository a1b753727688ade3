package crdstore

import (
	"maps"
	"strings"
	"testing"

	metav1validation "k8s.io/apimachinery/pkg/apis/meta/v1/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"

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
