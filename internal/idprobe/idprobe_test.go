package idprobe

import (
	"testing"

	"github.com/identityd/identityd/identity"
)

func TestProbeCoversTheRange(t *testing.T) {
	for _, cluster := range []identity.ClusterInfo{
		{Name: "default"},
		{ID: 7, Name: "c7"},
		{ID: 511, Name: "c511", MaxConnectedClusters: 511},
	} {
		p := New("k8s:app=web;", cluster)
		if p.Len() != uint64(cluster.MaxID()-cluster.MinID())+1 {
			t.Fatalf("%+v: n = %d", cluster, p.Len())
		}
		seen := make(map[identity.NumericIdentity]bool, p.Len())
		for i := range p.Len() {
			id := p.Slot(i)
			if id < cluster.MinID() || id > cluster.MaxID() || seen[id] {
				t.Fatalf("%+v: slot(%d) = %d, out of range or repeated", cluster, i, id)
			}
			seen[id] = true
			if pos, ok := p.Position(id); !ok || pos != i {
				t.Fatalf("%+v: position(slot(%d)) = %d, %v", cluster, i, pos, ok)
			}
		}
		if _, ok := p.Position(cluster.MaxID() + 1); ok {
			t.Errorf("%+v: an ID past the range has a position", cluster)
		}
	}
}

// TestProbeStartIsFixed pins the first slot of a label set: it is part of
// the format, shared by every node (docs/crd-store.md).
func TestProbeStartIsFixed(t *testing.T) {
	p := New("k8s:app=web;k8s:io.kubernetes.pod.namespace=prod;", identity.ClusterInfo{Name: "default"})
	// SHA-256 of the string, first 8 bytes big-endian, mod 65280, + 256.
	if got := p.Slot(0); got != 52321 {
		t.Errorf("slot(0) = %d, want 52321", got)
	}
}
