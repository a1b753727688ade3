package restoration

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/identityd/identityd/cells/metrics"
)

// Values of the result label of identityd_identity_restoration_prefixes.
const (
	prefixesRestored = "restored"
	prefixesFailed   = "failed"
)

// labelReason is the label of identityd_identity_restoration_skipped_map_entries_total.
const labelReason = "reason"

// Values of the reason label of
// identityd_identity_restoration_skipped_map_entries_total: an old map
// entry whose ID the checkpoint gives to the CIDR label set of another
// prefix, which the map gives that ID too (shared_id) or not (other_labels).
const (
	skippedSharedID    = "shared_id"
	skippedOtherLabels = "other_labels"
)

// newRestorationMetrics contributes the restorer's collector.
func newRestorationMetrics(r *Restorer) metrics.CollectorOut {
	return metrics.NewCollector(newRestorationCollector(r))
}

// restorationCollector reports what the restoration at this start did,
// read from the restorer's counters at scrape time. Gauges, because the
// values describe the one restoration of this process; a restart starts
// them again from zero.
type restorationCollector struct {
	r *Restorer

	identities, prefixes, skippedMapEntries *prometheus.Desc
}

func newRestorationCollector(r *Restorer) *restorationCollector {
	ns := metrics.Namespace
	return &restorationCollector{
		r: r,
		identities: prometheus.NewDesc(ns+"_identity_restoration",
			"Number of checkpointed identities by what restoration did with them at this start: restored, skipped, released_after_grace",
			[]string{metrics.LabelResult}, nil),
		prefixes: prometheus.NewDesc(ns+"_identity_restoration_prefixes",
			"Number of prefixes of the old datapath map that restoration re-created in the ipcache at this start (restored) or the ipcache refused (failed)",
			[]string{metrics.LabelResult}, nil),
		skippedMapEntries: prometheus.NewDesc(ns+"_identity_restoration_skipped_map_entries_total",
			"Number of old datapath map entries restoration skipped because the checkpoint gives their ID to another prefix's label set, by reason: shared_id, other_labels",
			[]string{labelReason}, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *restorationCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.identities
	ch <- c.prefixes
	ch <- c.skippedMapEntries
}

// Collect implements prometheus.Collector.
func (c *restorationCollector) Collect(ch chan<- prometheus.Metric) {
	n := c.r.Counters()
	gauge := func(d *prometheus.Desc, v uint64, result string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, float64(v), result)
	}
	gauge(c.identities, n.Restored, metrics.RestorationRestored)
	gauge(c.identities, n.Skipped, metrics.RestorationSkipped)
	gauge(c.identities, n.ReleasedAfterGrace, metrics.RestorationReleasedAfterGrace)
	gauge(c.prefixes, n.PrefixesRestored, prefixesRestored)
	gauge(c.prefixes, n.PrefixesFailed, prefixesFailed)
	// A counter: restoration only adds to it, and a restart starts a new
	// process, which Prometheus reads as a counter reset.
	ch <- prometheus.MustNewConstMetric(c.skippedMapEntries, prometheus.CounterValue, float64(n.MapEntriesSharedID), skippedSharedID)
	ch <- prometheus.MustNewConstMetric(c.skippedMapEntries, prometheus.CounterValue, float64(n.MapEntriesOtherLabels), skippedOtherLabels)
}
