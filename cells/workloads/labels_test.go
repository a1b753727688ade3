package workloads

import (
	"errors"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/identityd/identityd/labels"
)

func TestCiliumKey(t *testing.T) {
	for _, tc := range []struct{ k, v, key, value string }{
		{"app", "web", "app", "web"},
		{"reserved.foo", "bar", "foo", "bar"},
		{"reserved:host", "", "host", ""},
		{"reserved:", "world", "world", ""},
		{"$host", "", "host", ""},
		{"container:x", "1", "x", "1"},
		{"app.reserved.x", "1", "app.reserved.x", "1"},
	} {
		key, value, _ := ciliumKey(tc.k, tc.v)
		if key != tc.key || value != tc.value {
			t.Errorf("ciliumKey(%q, %q) = %q, %q; want %q, %q", tc.k, tc.v, key, value, tc.key, tc.value)
		}
	}
}

// TestPodLabelsKeyWrittenWins: a key "reserved.foo" reads as foo, as in
// Cilium; beside a label foo of the pod, foo's own value stays, on every
// call (Cilium keeps either, by map order).
func TestPodLabelsKeyWrittenWins(t *testing.T) {
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "n", Labels: map[string]string{"foo": "mine", "reserved.foo": "other"}}}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "n"}}
	for range 20 {
		ls, err := PodLabels(pod, ns, "default")
		if err != nil {
			t.Fatal(err)
		}
		if l, ok := ls.Get("foo"); !ok || l.Value != "mine" {
			t.Fatalf("foo = %v, want mine", l)
		}
	}
}

// TestPodLabelsRefusesWhatCannotRoundTrip: a value no API server lets
// through is an error naming the pod, never a label cut or rewritten.
func TestPodLabelsRefusesWhatCannotRoundTrip(t *testing.T) {
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "n", Labels: map[string]string{"app": "a\nb"}}}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "n"}}
	_, err := PodLabels(pod, ns, "default")
	var invalid *labels.InvalidLabelError
	if !errors.As(err, &invalid) || !strings.Contains(err.Error(), "pod n/p") {
		t.Fatalf("err = %v, want an invalid label of pod n/p", err)
	}
}

func TestNewLabelFilterErrors(t *testing.T) {
	for name, tc := range map[string]struct {
		file     string
		prefixes []string
	}{
		"empty prefix":   {prefixes: []string{"k8s:"}},
		"bad regexp":     {prefixes: []string{"k8s:("}},
		"file version":   {file: `{"version": 2}`},
		"file not JSON":  {file: `{`},
		"file empty":     {file: " "},
		"file no source": {file: `{"version": 1, "valid-prefixes": [{"prefix": "a"}]}`},
		"file no prefix": {file: `{"version": 1, "valid-prefixes": [{"source": "k8s"}]}`},
	} {
		var err error
		if tc.file != "" {
			_, err = NewLabelFilter(strings.NewReader(tc.file), tc.prefixes)
		} else {
			_, err = NewLabelFilter(nil, tc.prefixes)
		}
		if err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}
