// Package metricstest reads a running hive's /metrics endpoint in tests, so
// that a metric is checked the way Prometheus sees it.
package metricstest

import (
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/identityd/identityd/cells/metrics"
)

// Scrape fetches /metrics from addr and returns every sample as
// "name{labels}" -> value.
func Scrape(t testing.TB, addr string) map[string]float64 {
	t.Helper()
	resp, err := http.Get("http://" + addr + metrics.MetricsPath)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape: %d %v\n%s", resp.StatusCode, err, body)
	}
	out := map[string]float64{}
	for line := range strings.Lines(string(body)) {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			t.Fatalf("bad sample %q: %v", line, err)
		}
		out[line[:i]] = v
	}
	return out
}

// Expect reports every sample of want that samples lacks or has with
// another value.
func Expect(t testing.TB, samples map[string]float64, want map[string]float64) {
	t.Helper()
	for name, w := range want {
		got, ok := samples[name]
		if !ok {
			t.Errorf("%s missing", name)
			continue
		}
		if got != w {
			t.Errorf("%s = %v, want %v", name, got, w)
		}
	}
}
