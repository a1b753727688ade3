package metrics

import "github.com/prometheus/client_golang/prometheus"

// NewDesc describes the metric Namespace_name with the given variable
// labels and no constant ones, for a ScrapeCollector.
func NewDesc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc(Namespace+"_"+name, help, labels, nil)
}

// ScrapeCollector is the way a cell reports values it keeps itself (its
// atomic counters, the state of its tables): it names the metrics once and
// reads their values only when the registry is scraped, so the paths that
// count pay for their own increments and nothing else. Collectors that
// record events as they happen (histograms, vectors) go out with it, given
// to Include.
type ScrapeCollector struct {
	descs    []*prometheus.Desc
	included []prometheus.Collector
	read     func(Scrape)
}

// NewScrapeCollector returns the collector of the metrics descs, whose
// values read sends at each scrape. read must send only metrics of descs,
// with as many label values as each was described with.
func NewScrapeCollector(read func(Scrape), descs ...*prometheus.Desc) *ScrapeCollector {
	return &ScrapeCollector{descs: descs, read: read}
}

// Include makes c describe and collect cs as well, ahead of its own
// metrics, and returns c.
func (c *ScrapeCollector) Include(cs ...prometheus.Collector) *ScrapeCollector {
	c.included = append(c.included, cs...)
	return c
}

// Describe implements prometheus.Collector.
func (c *ScrapeCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, in := range c.included {
		in.Describe(ch)
	}
	for _, d := range c.descs {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *ScrapeCollector) Collect(ch chan<- prometheus.Metric) {
	for _, in := range c.included {
		in.Collect(ch)
	}
	c.read(Scrape{ch: ch})
}

// Scrape sends the values of one scrape.
type Scrape struct {
	ch chan<- prometheus.Metric
}

// Gauge sends the value v of the gauge d with the label values lv.
func (s Scrape) Gauge(d *prometheus.Desc, v float64, lv ...string) {
	s.ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, lv...)
}

// Counter sends the value v of the counter d with the label values lv.
func (s Scrape) Counter(d *prometheus.Desc, v float64, lv ...string) {
	s.ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, lv...)
}
