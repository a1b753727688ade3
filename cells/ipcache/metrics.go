package ipcache

import (
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/identityd/identityd/cells/metrics"
)

// newIPCacheMetrics contributes the ipcache's collector.
func newIPCacheMetrics(db *statedb.DB, c *IPCache) metrics.CollectorOut {
	return metrics.NewCollector(newIPCacheCollector(db, c.Table()))
}

// newIPCacheCollector reports the ipcache table's size and its
// reconciliation state towards the datapath map. Counting rows by status
// is one pass over the table per scrape, done in one read transaction
// without blocking writers.
func newIPCacheCollector(db *statedb.DB, table statedb.Table[*Entry]) *metrics.ScrapeCollector {
	var (
		entries = metrics.NewDesc("ipcache_entries",
			"Number of prefixes in the ipcache table")
		errors = metrics.NewDesc("ipcache_reconciliation_errors",
			"Number of ipcache prefixes whose last write to the datapath map failed (retried)")
		pending = metrics.NewDesc("ipcache_reconciliation_pending",
			"Number of ipcache prefixes waiting to be written to the datapath map")
	)
	return metrics.NewScrapeCollector(func(m metrics.Scrape) {
		txn := db.ReadTxn()
		var errs, waiting int
		for e := range table.All(txn) {
			switch e.Status.Kind {
			case reconciler.StatusKindError:
				errs++
			case reconciler.StatusKindPending:
				waiting++
			}
		}
		m.Gauge(entries, float64(table.NumObjects(txn)))
		m.Gauge(errors, float64(errs))
		m.Gauge(pending, float64(waiting))
	}, entries, errors, pending)
}
