package doublewrite

import (
	"github.com/identityd/identityd/cells/metrics"
)

// Outcomes of identityd_doublewrite_writes_total.
const (
	outcomeWritten = "written"
	outcomeTaken   = "taken"
	outcomeFailed  = "failed"
)

// newMetrics contributes the collector of the double-write modes.
func newMetrics(b *Backend) metrics.CollectorOut {
	if b == nil {
		return metrics.CollectorOut{}
	}
	return metrics.NewCollector(newCollector(b))
}

// newCollector reports the comparison of the stores with the names Cilium
// operator's double-write metric reporter gives them (prefixed identityd_
// for cilium_operator_), only on the node that reports it, and the writes
// to the write-only store on every node.
func newCollector(b *Backend) *metrics.ScrapeCollector {
	var (
		crdTotal = metrics.NewDesc("doublewrite_crd_identities",
			"The total number of CRD identities (in a double-write identity allocation mode, on the node that reports the comparison)")
		kvTotal = metrics.NewDesc("doublewrite_kvstore_identities",
			"The total number of identities in the KVStore (in a double-write identity allocation mode, on the node that reports the comparison)")
		crdOnly = metrics.NewDesc("doublewrite_crd_only_identities",
			"The number of CRD identities not present in the KVStore (in a double-write identity allocation mode, on the node that reports the comparison)")
		kvOnly = metrics.NewDesc("doublewrite_kvstore_only_identities",
			"The number of identities in the KVStore not present as a CRD (in a double-write identity allocation mode, on the node that reports the comparison)")
		differ = metrics.NewDesc("doublewrite_labels_differ_identities",
			"The number of IDs that the KVStore and the CRDs give different label sets (in a double-write identity allocation mode, on the node that reports the comparison)")
		writes = metrics.NewDesc("doublewrite_writes_total",
			"Writes of global identities this node uses to the write-only store, by outcome: written, taken (the ID belongs to another label set there; counted once until written or released), failed (retried)",
			metrics.LabelOutcome)
		taken = metrics.NewDesc("doublewrite_taken_identities",
			"Global identities this node uses whose ID the write-only store gives to another label set now")
	)
	return metrics.NewScrapeCollector(func(m metrics.Scrape) {
		st := b.WriteStats()
		m.Counter(writes, float64(st.Written), outcomeWritten)
		m.Counter(writes, float64(st.TakenTotal), outcomeTaken)
		m.Counter(writes, float64(st.Failed), outcomeFailed)
		m.Gauge(taken, float64(st.Taken))
		r := b.LastReport()
		if r == nil {
			return
		}
		m.Gauge(crdTotal, float64(r.CRD))
		m.Gauge(kvTotal, float64(r.KVStore))
		m.Gauge(crdOnly, float64(r.Count(OnlyCRD)))
		m.Gauge(kvOnly, float64(r.Count(OnlyKVStore)))
		m.Gauge(differ, float64(r.Count(Mismatch)))
	}, crdTotal, kvTotal, crdOnly, kvOnly, differ, writes, taken)
}
