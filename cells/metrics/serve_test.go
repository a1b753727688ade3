package metrics_test

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/internal/testhive"
)

// blockingCollector holds a scrape until released.
type blockingCollector struct {
	desc     *prometheus.Desc
	entered  chan struct{}
	released chan struct{}
}

func (c *blockingCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *blockingCollector) Collect(ch chan<- prometheus.Metric) {
	select {
	case c.entered <- struct{}{}:
	default:
	}
	<-c.released
	ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, 1)
}

// TestServeJobStop: with a job registry the endpoint is served by the job
// serve-http, whose health scope is OK while it serves; at stop, a scrape
// in flight finishes (the stop waits for it) and then nothing is served.
func TestServeJobStop(t *testing.T) {
	bc := &blockingCollector{
		desc:     prometheus.NewDesc("identityd_test_blocking", "held until released", nil, nil),
		entered:  make(chan struct{}, 1),
		released: make(chan struct{}),
	}
	var p *health.Provider
	th := newHive(t, "127.0.0.1:0", job.Cell,
		cell.Provide(func() metrics.CollectorOut { return metrics.NewCollector(bc) }),
		cell.Invoke(func(x *health.Provider) { p = x }),
	)
	running := testhive.Start(t, th.h)
	addr := th.server.Addr()
	if code, body := get(t, "http://"+addr+metrics.HealthPath); code != http.StatusOK ||
		!strings.Contains(body, "job-"+metrics.ServeJob+`: level=OK message="Serving on `+addr+`"`) {
		t.Fatalf("healthz: %d %s", code, body)
	}

	type answer struct {
		code int
		body string
	}
	scraped := make(chan answer, 1)
	go func() {
		resp, err := http.Get("http://" + addr + metrics.MetricsPath)
		if err != nil {
			scraped <- answer{0, err.Error()}
			return
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		scraped <- answer{resp.StatusCode, string(b)}
	}()
	select {
	case <-bc.entered:
	case <-time.After(30 * time.Second):
		t.Fatal("scrape did not reach the collector")
	}
	stopped := make(chan struct{})
	go func() {
		running.Stop() // fails the test on an error
		close(stopped)
	}()
	select {
	case <-stopped:
		t.Fatal("stop returned while a scrape was in flight")
	case <-time.After(500 * time.Millisecond):
	}
	close(bc.released)
	select {
	case a := <-scraped:
		if a.code != http.StatusOK || !strings.Contains(a.body, "identityd_test_blocking 1") {
			t.Errorf("scrape in flight at stop: %d %s", a.code, a.body)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("scrape in flight at stop did not finish")
	}
	select {
	case <-stopped:
	case <-time.After(30 * time.Second):
		t.Fatal("stop did not return after the scrape finished")
	}
	if _, err := http.Get("http://" + addr + metrics.HealthPath); err == nil {
		t.Error("endpoint still served after stop")
	}
	for _, st := range p.All() {
		if st.Name == "job-"+metrics.ServeJob && st.Level != cell.StatusStopped {
			t.Errorf("serve job after stop: %+v", st)
		}
	}
}
