package crdstore

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/identityd/identityd/identity"
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

// probe is a label set's probe sequence over this cluster's range:
// slot(i) = min + (h + i) mod n, with h the first 8 bytes of the SHA-256 of
// the canonical string read big-endian, and n the size of the range.
type probe struct {
	min   uint64
	n     uint64
	start uint64 // h mod n
}

func newProbe(canonical string, cluster identity.ClusterInfo) probe {
	sum := sha256.Sum256([]byte(canonical))
	h := binary.BigEndian.Uint64(sum[:8])
	lo, hi := uint64(cluster.MinID()), uint64(cluster.MaxID())
	n := hi - lo + 1
	return probe{min: lo, n: n, start: h % n}
}

// slot returns the ID at position i (0 <= i < n). (h + i) mod n is
// computed as ((h mod n) + i) mod n, which is the same number without the
// overflow of h + i.
func (p probe) slot(i uint64) identity.NumericIdentity {
	return identity.NumericIdentity(p.min + (p.start+i)%p.n)
}

// position returns the position of id in the sequence, and false when id
// is outside the range.
func (p probe) position(id identity.NumericIdentity) (uint64, bool) {
	v := uint64(id)
	if v < p.min || v >= p.min+p.n {
		return 0, false
	}
	return (v - p.min + p.n - p.start) % p.n, true
}
