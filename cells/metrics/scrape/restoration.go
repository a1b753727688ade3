package scrape

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/cells/restoration"
)

// Values of the result label of identityd_identity_restoration_prefixes.
const (
	PrefixesRestored = "restored"
	PrefixesFailed   = "failed"
)

// RestorationCollector reports what the restoration at this start did,
// read from the restorer's counters at scrape time. Gauges, because the
// values describe the one restoration of this process; a restart starts
// them again from zero.
type RestorationCollector struct {
	r *restoration.Restorer

	identities, prefixes *prometheus.Desc
}

// NewRestorationCollector returns a collector reading r.
func NewRestorationCollector(r *restoration.Restorer) *RestorationCollector {
	ns := metrics.Namespace
	return &RestorationCollector{
		r: r,
		identities: prometheus.NewDesc(ns+"_identity_restoration",
			"Number of checkpointed identities by what restoration did with them at this start: restored, skipped, released_after_grace",
			[]string{metrics.LabelResult}, nil),
		prefixes: prometheus.NewDesc(ns+"_identity_restoration_prefixes",
			"Number of prefixes of the old datapath map that restoration re-created in the ipcache at this start (restored) or the ipcache refused (failed)",
			[]string{metrics.LabelResult}, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *RestorationCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.identities
	ch <- c.prefixes
}

// Collect implements prometheus.Collector.
func (c *RestorationCollector) Collect(ch chan<- prometheus.Metric) {
	n := c.r.Counters()
	gauge := func(d *prometheus.Desc, v uint64, result string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, float64(v), result)
	}
	gauge(c.identities, n.Restored, metrics.RestorationRestored)
	gauge(c.identities, n.Skipped, metrics.RestorationSkipped)
	gauge(c.identities, n.ReleasedAfterGrace, metrics.RestorationReleasedAfterGrace)
	gauge(c.prefixes, n.PrefixesRestored, PrefixesRestored)
	gauge(c.prefixes, n.PrefixesFailed, PrefixesFailed)
}
