package ciliumanchor

import (
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/cilium/pkg/k8s"
	slim_corev1 "github.com/cilium/cilium/pkg/k8s/slim/k8s/api/core/v1"
	slim_metav1 "github.com/cilium/cilium/pkg/k8s/slim/k8s/apis/meta/v1"
	"github.com/cilium/cilium/pkg/labels"
	"github.com/cilium/cilium/pkg/labelsfilter"
	"github.com/cilium/cilium/pkg/option"
)

var update = flag.Bool("update", false, "rewrite the golden file of Cilium's pod labels")

// The shapes identityd's label derivation is compared on, and what Cilium's
// own code makes of them: identityd's cells/workloads tests read both.
const (
	shapesFile = "../../cells/workloads/testdata/cilium-shapes.json"
	goldenFile = "../../cells/workloads/testdata/cilium-labels.json"
)

// podShape is one pod, its namespace and the agent's label settings.
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

// podResult is the identity labels of a shape as [source, key, value]
// triples in key order, or that the settings were refused.
type podResult struct {
	Labels  [][3]string `json:"labels,omitempty"`
	Refused bool        `json:"refused,omitempty"`
}

// TestPodLabelsAsCilium computes each shape's identity labels with Cilium
// v1.16.2's agent code (the path of fetchK8sMetadataForEndpoint:
// GetPodMetadata, Map2Labels with source k8s, labelsfilter.Filter) and
// compares them with the golden file, or rewrites it with -update.
func TestPodLabelsAsCilium(t *testing.T) {
	data, err := os.ReadFile(shapesFile)
	if err != nil {
		t.Fatal(err)
	}
	var shapes []podShape
	if err := json.Unmarshal(data, &shapes); err != nil {
		t.Fatal(err)
	}
	got := map[string]podResult{}
	for _, s := range shapes {
		got[s.Name] = ciliumPodLabels(t, s)
	}
	if *update {
		b, err := json.MarshalIndent(got, "", " ")
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(goldenFile, append(b, '\n'), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	b, err := os.ReadFile(goldenFile)
	if err != nil {
		t.Fatal(err)
	}
	var want map[string]podResult
	if err := json.Unmarshal(b, &want); err != nil {
		t.Fatal(err)
	}
	for _, s := range shapes {
		if g, w := got[s.Name], want[s.Name]; g.Refused != w.Refused || !slices.Equal(g.Labels, w.Labels) {
			t.Errorf("%s: Cilium gives %+v, the golden file %+v (go test -update rewrites it)", s.Name, g, w)
		}
	}
}

func ciliumPodLabels(t *testing.T, s podShape) podResult {
	file := ""
	if s.PrefixFile != nil {
		file = filepath.Join(t.TempDir(), "prefixes.json")
		if err := os.WriteFile(file, []byte(*s.PrefixFile), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := labelsfilter.ParseLabelPrefixCfg(s.Labels, nil, file); err != nil {
		return podResult{Refused: true}
	}
	option.Config.ClusterName = s.Cluster
	ns := &slim_corev1.Namespace{ObjectMeta: slim_metav1.ObjectMeta{Name: s.Namespace.Name, Labels: s.Namespace.Labels}}
	pod := &slim_corev1.Pod{
		ObjectMeta: slim_metav1.ObjectMeta{Name: "pod", Namespace: s.Namespace.Name, Labels: s.PodLabels},
		Spec:       slim_corev1.PodSpec{ServiceAccountName: s.ServiceAccount},
	}
	_, lbls, _, err := k8s.GetPodMetadata(ns, pod)
	if err != nil {
		t.Fatalf("%s: %v", s.Name, err)
	}
	ids, _ := labelsfilter.Filter(labels.Map2Labels(lbls, labels.LabelSourceK8s))
	var r podResult
	for _, l := range ids {
		r.Labels = append(r.Labels, [3]string{l.Source, l.Key, l.Value})
	}
	slices.SortFunc(r.Labels, func(a, b [3]string) int { return strings.Compare(a[1], b[1]) })
	return r
}
