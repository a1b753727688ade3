package scrape

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/cells/metrics"
)

// GCStatser is a global backend that counts its garbage collection, as
// *etcdstore.Store does. Other backends have no GC to report.
type GCStatser interface {
	GCStats() etcdstore.GCStats
}

// Values of the status label of identityd_identity_gc_entries that only
// identityd has: unreferenced master keys whose delete transaction found
// them referenced (or changed) again, and so kept them.
const GCStatusSkipped = "skipped"

// GCCollector reports the garbage collection of global identities, read
// from the backend's counters at scrape time.
//
// The backend keeps running totals, not the result of each run, so
// identityd_identity_gc_entries counts master keys since the agent started
// rather than those of the last run as Cilium's does, and has no "alive"
// series (the GC never counts the keys it keeps; a key in use is not a
// candidate). The names and gauge types are Cilium's so that its
// dashboards find the series.
type GCCollector struct {
	backend GCStatser

	entries, runs *prometheus.Desc
}

// NewGCCollector returns a collector reading b.
func NewGCCollector(b GCStatser) *GCCollector {
	ns := metrics.Namespace
	return &GCCollector{
		backend: b,
		entries: prometheus.NewDesc(ns+"_identity_gc_entries",
			"Number of global identities the garbage collection deleted, or skipped because they were referenced again, since the agent started, by status",
			[]string{metrics.LabelStatus}, nil),
		runs: prometheus.NewDesc(ns+"_identity_gc_runs",
			"Number of identity garbage collection runs since the agent started, by outcome (a run in progress counts as success)",
			[]string{metrics.LabelOutcome}, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *GCCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.entries
	ch <- c.runs
}

// Collect implements prometheus.Collector.
func (c *GCCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.backend.GCStats()
	gauge := func(d *prometheus.Desc, v uint64, label string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, float64(v), label)
	}
	gauge(c.entries, st.Deleted, metrics.GCStatusDeleted)
	gauge(c.entries, st.Skipped, GCStatusSkipped)
	// Runs counts a run when it begins and Failed when it ends in an
	// error, so the difference is never negative.
	gauge(c.runs, st.Runs-st.Failed, metrics.OutcomeSuccess)
	gauge(c.runs, st.Failed, metrics.OutcomeFailure)
}
