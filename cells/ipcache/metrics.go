package ipcache

import (
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/identityd/identityd/cells/metrics"
)

// newIPCacheMetrics contributes the ipcache's collector.
func newIPCacheMetrics(db *statedb.DB, c *IPCache) metrics.CollectorOut {
	return metrics.NewCollector(newIPCacheCollector(db, c.Table()))
}

// ipcacheCollector reports the ipcache table's size and its reconciliation state
// towards the datapath map. Counting rows by status is one pass over the
// table per scrape (tens of milliseconds at a million prefixes), done in
// one read transaction without blocking writers.
type ipcacheCollector struct {
	db    *statedb.DB
	table statedb.Table[*Entry]

	entries, errors, pending *prometheus.Desc
}

func newIPCacheCollector(db *statedb.DB, table statedb.Table[*Entry]) *ipcacheCollector {
	ns := metrics.Namespace
	return &ipcacheCollector{
		db:    db,
		table: table,
		entries: prometheus.NewDesc(ns+"_ipcache_entries",
			"Number of prefixes in the ipcache table", nil, nil),
		errors: prometheus.NewDesc(ns+"_ipcache_reconciliation_errors",
			"Number of ipcache prefixes whose last write to the datapath map failed (retried)", nil, nil),
		pending: prometheus.NewDesc(ns+"_ipcache_reconciliation_pending",
			"Number of ipcache prefixes waiting to be written to the datapath map", nil, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *ipcacheCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.entries
	ch <- c.errors
	ch <- c.pending
}

// Collect implements prometheus.Collector.
func (c *ipcacheCollector) Collect(ch chan<- prometheus.Metric) {
	txn := c.db.ReadTxn()
	var errs, pending int
	for e := range c.table.All(txn) {
		switch e.Status.Kind {
		case reconciler.StatusKindError:
			errs++
		case reconciler.StatusKindPending:
			pending++
		}
	}
	ch <- prometheus.MustNewConstMetric(c.entries, prometheus.GaugeValue, float64(c.table.NumObjects(txn)))
	ch <- prometheus.MustNewConstMetric(c.errors, prometheus.GaugeValue, float64(errs))
	ch <- prometheus.MustNewConstMetric(c.pending, prometheus.GaugeValue, float64(pending))
}
