package doublewrite

import (
	"cmp"
	"slices"
	"strconv"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/identity"
)

// maxLoggedDiffs bounds the IDs a report's log line names of each kind.
const maxLoggedDiffs = 5

// Report is a comparison of the global identities of this cluster's range
// in the two stores, as this node's caches of them hold them.
type Report struct {
	// KVStore and CRD are the numbers of identities in each store.
	KVStore, CRD int
	// Diffs are the IDs held by one store only, or by both with different
	// label sets, in ID order.
	Diffs []Diff
	// Synced is false while a store's cache has not completed its first
	// listing: the numbers are then partial.
	Synced bool
}

// Diff kinds.
const (
	OnlyKVStore = "kvstore-only"
	OnlyCRD     = "crd-only"
	Mismatch    = "labels-differ"
)

// Diff is one ID whose identity the stores do not share.
type Diff struct {
	ID   identity.NumericIdentity `json:"id"`
	Kind string                   `json:"kind"`
	// KVStoreLabels and CRDLabels are the label sets' canonical strings,
	// empty where the store does not hold the ID.
	KVStoreLabels string `json:"kvstoreLabels,omitempty"`
	CRDLabels     string `json:"crdLabels,omitempty"`
}

// TableHeader names the columns of doublewrite/diff's table.
func (Diff) TableHeader() []string { return []string{"ID", "Kind", "KVStore", "CRD"} }

// TableRow is the difference as a row of doublewrite/diff's table.
func (d Diff) TableRow() []string {
	return []string{strconv.FormatUint(uint64(d.ID), 10), d.Kind, d.KVStoreLabels, d.CRDLabels}
}

// Count returns the number of diffs of kind.
func (r *Report) Count(kind string) int {
	n := 0
	for _, d := range r.Diffs {
		if d.Kind == kind {
			n++
		}
	}
	return n
}

// Compare compares the two stores now, from this node's caches (no
// request to either store).
func (b *Backend) Compare() *Report {
	kv := b.views[identity.AllocationModeKVStore]
	crd := b.views[identity.AllocationModeCRD]
	k, c := kv.snapshot(), crd.snapshot()
	r := &Report{KVStore: len(k), CRD: len(c), Synced: kv.synced.Load() && crd.synced.Load()}
	for id, kl := range k {
		switch cl, ok := c[id]; {
		case !ok:
			r.Diffs = append(r.Diffs, Diff{ID: id, Kind: OnlyKVStore, KVStoreLabels: kl})
		case cl != kl:
			r.Diffs = append(r.Diffs, Diff{ID: id, Kind: Mismatch, KVStoreLabels: kl, CRDLabels: cl})
		}
	}
	for id, cl := range c {
		if _, ok := k[id]; !ok {
			r.Diffs = append(r.Diffs, Diff{ID: id, Kind: OnlyCRD, CRDLabels: cl})
		}
	}
	slices.SortFunc(r.Diffs, func(a, b Diff) int { return cmp.Compare(a.ID, b.ID) })
	return r
}

// Reporting reports whether this node publishes the comparison: it
// collects in the read store (one node of the cluster does), or the read
// store elects no collector (--identity-gc-interval=0), and then every
// node does.
func (b *Backend) Reporting() bool {
	c, ok := b.read.(globalstore.Collector)
	if !ok {
		return true
	}
	if c.Collecting() {
		return true
	}
	return !b.electsCollector()
}

// electsCollector is set by the cell from --identity-gc-interval.
func (b *Backend) electsCollector() bool { return b.gcElection }

// compareIfCollecting publishes the comparison on the node that reports,
// and withdraws it on the others, as Cilium's operator reports it (its
// log line names at most maxLoggedDiffs IDs of each kind).
func (b *Backend) compareIfCollecting() {
	if !b.Reporting() {
		b.report.Store(nil)
		return
	}
	r := b.Compare()
	if !r.Synced {
		return
	}
	b.report.Store(r)
	onlyKV, onlyCRD, differ := r.Count(OnlyKVStore), r.Count(OnlyCRD), r.Count(Mismatch)
	if len(r.Diffs) == 0 {
		b.log.Info("CRD and kvstore identities are in sync", "identities", r.KVStore)
		return
	}
	sample := func(kind string) []identity.NumericIdentity {
		var out []identity.NumericIdentity
		for _, d := range r.Diffs {
			if d.Kind == kind && len(out) < maxLoggedDiffs {
				out = append(out, d.ID)
			}
		}
		return out
	}
	b.log.Info("Detected differences between CRD and kvstore identities (identityd shell -- doublewrite/diff lists them)",
		"crdIdentities", r.CRD, "kvstoreIdentities", r.KVStore,
		"onlyInCRD", onlyCRD, "onlyInKVStore", onlyKV, "labelsDiffer", differ,
		"onlyInCRDSample", sample(OnlyCRD), "onlyInKVStoreSample", sample(OnlyKVStore), "labelsDifferSample", sample(Mismatch))
}

// LastReport returns the comparison this node last published, nil when
// it does not report.
func (b *Backend) LastReport() *Report { return b.report.Load() }
