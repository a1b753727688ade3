package crdstore

import (
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/identityd/identityd/labels"
)

// namespaceLabelsPrefix marks the labels Cilium synthesizes from the pod's
// namespace labels; Cilium leaves them out of the object's labels (their
// keys are user input and often too long for a label name).
const namespaceLabelsPrefix = "io.cilium.k8s.namespace.labels."

// securityLabels is the label set as the object's security-labels map:
// "source:key" to value.
func securityLabels(lbls labels.Labels) map[string]string {
	m := make(map[string]string, len(lbls))
	for _, l := range lbls {
		m[l.Source+":"+l.Key] = l.Value
	}
	return m
}

// parseSecurityLabels reads an object's security-labels map back into a
// label set. Sources hold no ':', so the first one ends the source.
func parseSecurityLabels(m map[string]string) (labels.Labels, error) {
	ls := make([]labels.Label, 0, len(m))
	for k, v := range m {
		src, key, ok := strings.Cut(k, ":")
		if !ok {
			return nil, fmt.Errorf("security label %q has no source", k)
		}
		if src == "" {
			return nil, fmt.Errorf("security label %q has an empty source", k)
		}
		ls = append(ls, labels.Label{Source: src, Key: key, Value: v})
	}
	return labels.New(ls...)
}

// objectLabels selects the object's metadata.labels as Cilium v1.16 does
// (each k8s label without its "k8s:" prefix, except the namespace labels),
// and then leaves out every key and value the API server refuses: Cilium
// copies them unchecked, so an identity with a label value such as "a=b"
// can never be created, and retries forever. What is left out stays in
// security-labels, which alone decides the identity. skipped counts the
// k8s labels left out because the API server would refuse them.
func objectLabels(lbls labels.Labels) (selected map[string]string, skipped int) {
	for _, l := range lbls {
		if l.Source != labels.SourceK8s || strings.HasPrefix(l.Key, namespaceLabelsPrefix) {
			continue
		}
		if len(validation.IsQualifiedName(l.Key)) > 0 || len(validation.IsValidLabelValue(l.Value)) > 0 {
			skipped++
			continue
		}
		if selected == nil {
			selected = map[string]string{}
		}
		selected[l.Key] = l.Value
	}
	return selected, skipped
}
