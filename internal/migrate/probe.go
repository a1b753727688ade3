package migrate

import (
	"crypto/sha256"
	"encoding/binary"

	"github.com/identityd/identityd/identity"
)

// probe is a label set's probe sequence over the cluster's range, the CRD
// store's placement of a new label set (docs/crd-store.md, "Placement"):
// slot(i) = min + (h + i) mod n, h the first 8 bytes of the SHA-256 of the
// canonical string read big-endian, n the size of the range.
// TestPlacementMatchesCRDStore checks it against the store's allocations.
type probe struct {
	min, n, start uint64
}

func newProbe(canonical string, cluster identity.ClusterInfo) probe {
	sum := sha256.Sum256([]byte(canonical))
	h := binary.BigEndian.Uint64(sum[:8])
	lo, hi := uint64(cluster.MinID()), uint64(cluster.MaxID())
	n := hi - lo + 1
	return probe{min: lo, n: n, start: h % n}
}

// slot returns the ID at position i, computing (h + i) mod n as
// ((h mod n) + i) mod n to avoid the overflow of h + i.
func (p probe) slot(i uint64) identity.NumericIdentity {
	return identity.NumericIdentity(p.min + (p.start+i)%p.n)
}
