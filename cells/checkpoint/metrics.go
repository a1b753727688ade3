package checkpoint

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/identityd/identityd/cells/metrics"
)

// newCheckpointMetrics contributes the checkpoint's collector.
func newCheckpointMetrics(c *Checkpoint) metrics.CollectorOut {
	return metrics.NewCollector(newCheckpointCollector(c))
}

// newCheckpointCollector reports the checkpoint's last write and its event
// counters, read from Checkpoint.Status (no I/O).
func newCheckpointCollector(cp *Checkpoint) *metrics.ScrapeCollector {
	d := func(name, help string) *prometheus.Desc { return metrics.NewDesc("checkpoint_"+name, help) }
	var (
		duration    = d("write_duration_seconds", "Duration of the last successful checkpoint write: snapshot, encoding and atomic write with fsyncs")
		size        = d("size_bytes", "Size of the checkpoint file after the last successful write")
		entries     = d("entries", "Number of identities in the last successful checkpoint write")
		lastSuccess = d("last_success_timestamp_seconds", "Unix time of the start of the last successful checkpoint write, 0 if none")
		lastFailed  = d("last_write_failed", "1 when the last checkpoint write failed, else 0")
		pending     = d("pending", "1 when a local identity change waits for the next checkpoint write, else 0")
		writes      = d("writes_total", "Number of successful checkpoint writes")
		failures    = d("write_failures_total", "Number of failed checkpoint writes")
		loads       = d("loads_total", "Number of checkpoint loads")
		corrupt     = d("corrupt_files_total", "Number of checkpoint files found corrupt on load (kept aside, not restored)")
		invalid     = d("invalid_entries_total", "Number of checkpoint entries skipped on load as invalid")
	)
	return metrics.NewScrapeCollector(func(m metrics.Scrape) {
		st := cp.Status()
		m.Gauge(duration, st.Duration.Seconds())
		m.Gauge(size, float64(st.Size))
		m.Gauge(entries, float64(st.Entries))
		var last float64
		if !st.LastWrite.IsZero() {
			last = float64(st.LastWrite.UnixNano()) / 1e9
		}
		m.Gauge(lastSuccess, last)
		m.Gauge(lastFailed, metrics.BoolValue(st.LastError != nil))
		m.Gauge(pending, metrics.BoolValue(st.Pending))
		m.Counter(writes, float64(st.Counters.Writes))
		m.Counter(failures, float64(st.Counters.WriteFailures))
		m.Counter(loads, float64(st.Counters.Loads))
		m.Counter(corrupt, float64(st.Counters.CorruptFiles))
		m.Counter(invalid, float64(st.Counters.InvalidEntries))
	}, duration, size, entries, lastSuccess, lastFailed, pending, writes, failures, loads, corrupt, invalid)
}
