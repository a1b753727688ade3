package workloads_test

import (
	"encoding/json"
	"io"
	"os"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/identityd/identityd/cells/workloads"
)

// podShape and podResult are the shapes of testdata/cilium-shapes.json
// and the identity labels Cilium v1.16.2's agent code gives them,
// testdata/cilium-labels.json, which `make anchor-labels` checks against
// Cilium's code (internal/ciliumanchor, TestPodLabelsAsCilium).
type podShape struct {
	Name      string            `json:"name"`
	PodLabels map[string]string `json:"podLabels"`
	Namespace struct {
		Name   string            `json:"name"`
		Labels map[string]string `json:"labels"`
	} `json:"namespace"`
	ServiceAccount string   `json:"serviceAccount"`
	Cluster        string   `json:"cluster"`
	PrefixFile     *string  `json:"prefixFile"`
	Labels         []string `json:"labels"`
}

type podResult struct {
	Labels  [][3]string `json:"labels,omitempty"`
	Refused bool        `json:"refused,omitempty"`
}

// TestSameLabelsAsCilium: on every shape, identityd's identity labels are
// Cilium's, and identityd refuses exactly the settings Cilium refuses.
func TestSameLabelsAsCilium(t *testing.T) {
	var shapes []podShape
	readJSON(t, "testdata/cilium-shapes.json", &shapes)
	var want map[string]podResult
	readJSON(t, "testdata/cilium-labels.json", &want)
	if len(shapes) < 50 || len(want) != len(shapes) {
		t.Fatalf("%d shapes, %d results of Cilium: want at least 50, one each", len(shapes), len(want))
	}
	differ := 0
	for _, s := range shapes {
		w, ok := want[s.Name]
		if !ok {
			t.Fatalf("%s: no result of Cilium (make anchor-labels ANCHOR_UPDATE=1)", s.Name)
		}
		got := identitydPodLabels(t, s)
		if got.Refused != w.Refused || !slices.Equal(got.Labels, w.Labels) {
			differ++
			t.Errorf("%s: identityd gives %v, Cilium %v", s.Name, got, w)
		}
	}
	t.Logf("%d shapes, %d differences", len(shapes), differ)
}

func identitydPodLabels(t *testing.T, s podShape) podResult {
	t.Helper()
	var file io.Reader
	if s.PrefixFile != nil {
		file = strings.NewReader(*s.PrefixFile)
	}
	filter, err := workloads.NewLabelFilter(file, s.Labels)
	if err != nil {
		return podResult{Refused: true}
	}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: s.Namespace.Name, Labels: s.Namespace.Labels}}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "pod", Namespace: s.Namespace.Name, Labels: s.PodLabels},
		Spec:       corev1.PodSpec{ServiceAccountName: s.ServiceAccount},
	}
	ids, err := filter.PodIdentityLabels(pod, ns, s.Cluster)
	if err != nil {
		t.Fatalf("%s: %v", s.Name, err)
	}
	var r podResult
	for _, l := range ids {
		r.Labels = append(r.Labels, [3]string{l.Source, l.Key, l.Value})
	}
	return r
}

func readJSON(t *testing.T, path string, v any) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}
