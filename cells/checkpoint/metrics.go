package checkpoint

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/identityd/identityd/cells/metrics"
)

// newCheckpointMetrics contributes the checkpoint's collector.
func newCheckpointMetrics(c *Checkpoint) metrics.CollectorOut {
	return metrics.NewCollector(newCheckpointCollector(c))
}

// checkpointCollector reports the checkpoint's last write and its event
// counters, read from Checkpoint.Status (no I/O).
type checkpointCollector struct {
	cp *Checkpoint

	duration, size, entries, lastSuccess, lastFailed, pending *prometheus.Desc
	writes, failures, loads, corrupt, invalid                 *prometheus.Desc
}

func newCheckpointCollector(cp *Checkpoint) *checkpointCollector {
	d := func(name, help string) *prometheus.Desc {
		return prometheus.NewDesc(metrics.Namespace+"_checkpoint_"+name, help, nil, nil)
	}
	return &checkpointCollector{
		cp:          cp,
		duration:    d("write_duration_seconds", "Duration of the last successful checkpoint write: snapshot, encoding and atomic write with fsyncs"),
		size:        d("size_bytes", "Size of the checkpoint file after the last successful write"),
		entries:     d("entries", "Number of identities in the last successful checkpoint write"),
		lastSuccess: d("last_success_timestamp_seconds", "Unix time of the start of the last successful checkpoint write, 0 if none"),
		lastFailed:  d("last_write_failed", "1 when the last checkpoint write failed, else 0"),
		pending:     d("pending", "1 when a local identity change waits for the next checkpoint write, else 0"),
		writes:      d("writes_total", "Number of successful checkpoint writes"),
		failures:    d("write_failures_total", "Number of failed checkpoint writes"),
		loads:       d("loads_total", "Number of checkpoint loads"),
		corrupt:     d("corrupt_files_total", "Number of checkpoint files found corrupt on load (kept aside, not restored)"),
		invalid:     d("invalid_entries_total", "Number of checkpoint entries skipped on load as invalid"),
	}
}

// Describe implements prometheus.Collector.
func (c *checkpointCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.duration, c.size, c.entries, c.lastSuccess, c.lastFailed, c.pending,
		c.writes, c.failures, c.loads, c.corrupt, c.invalid} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *checkpointCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.cp.Status()
	gauge := func(d *prometheus.Desc, v float64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v)
	}
	counter := func(d *prometheus.Desc, v uint64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v))
	}
	gauge(c.duration, st.Duration.Seconds())
	gauge(c.size, float64(st.Size))
	gauge(c.entries, float64(st.Entries))
	var last float64
	if !st.LastWrite.IsZero() {
		last = float64(st.LastWrite.UnixNano()) / 1e9
	}
	gauge(c.lastSuccess, last)
	gauge(c.lastFailed, metrics.BoolValue(st.LastError != nil))
	gauge(c.pending, metrics.BoolValue(st.Pending))
	counter(c.writes, st.Counters.Writes)
	counter(c.failures, st.Counters.WriteFailures)
	counter(c.loads, st.Counters.Loads)
	counter(c.corrupt, st.Counters.CorruptFiles)
	counter(c.invalid, st.Counters.InvalidEntries)
}
