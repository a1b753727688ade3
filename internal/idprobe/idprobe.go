// Package idprobe is the order in which the CRD store tries the IDs of the
// cluster's range for a new label set (docs/crd-store.md, "Placement"), so
// that nodes racing on one label set try the same IDs in the same order.
// identityd migrate places label sets in the same order.
package idprobe

import (
	"crypto/sha256"
	"encoding/binary"

	"github.com/identityd/identityd/identity"
)

// Sequence is a label set's probe sequence over a cluster's range:
// Slot(i) = min + (h + i) mod n, with h the first 8 bytes of the SHA-256 of
// the canonical string read big-endian, and n the size of the range.
type Sequence struct {
	min   uint64
	n     uint64
	start uint64 // h mod n
}

// New returns the probe sequence of the label set whose canonical string
// is canonical, over cluster's range.
func New(canonical string, cluster identity.ClusterInfo) Sequence {
	return NewRange(canonical, cluster.MinID(), cluster.MaxID())
}

// NewRange returns the probe sequence of the label set whose canonical
// string is canonical, over the IDs lo..hi (lo <= hi): New over a part of
// a cluster's range, as the CRD store's tests narrow it to fill it quickly.
func NewRange(canonical string, lo, hi identity.NumericIdentity) Sequence {
	sum := sha256.Sum256([]byte(canonical))
	h := binary.BigEndian.Uint64(sum[:8])
	n := uint64(hi) - uint64(lo) + 1
	return Sequence{min: uint64(lo), n: n, start: h % n}
}

// Len is the length of the sequence: the size of the range, each of
// whose IDs it names once.
func (p Sequence) Len() uint64 { return p.n }

// Slot returns the ID at position i (0 <= i < n). (h + i) mod n is
// computed as ((h mod n) + i) mod n, which is the same number without the
// overflow of h + i.
func (p Sequence) Slot(i uint64) identity.NumericIdentity {
	return identity.NumericIdentity(p.min + (p.start+i)%p.n)
}

// Position returns the position of id in the sequence, and false when id
// is outside the range.
func (p Sequence) Position(id identity.NumericIdentity) (uint64, bool) {
	v := uint64(id)
	if v < p.min || v >= p.min+p.n {
		return 0, false
	}
	return (v - p.min + p.n - p.start) % p.n, true
}
