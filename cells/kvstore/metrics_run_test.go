package kvstore

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive/hivetest"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// The scrapes' status requests run in the client's run: not before its
// start (there is no connection), not on the start hook's context (which
// ends when the start is over), and until the client's stop path ends.
func TestClientCollectorRun(t *testing.T) {
	cfg := DefaultConfig
	cfg.NodeName = "collector-run"
	cfg.KVStoreEndpoints = []string{"http://127.0.0.1:1", "http://127.0.0.1:2"}
	c, err := New(hivetest.Logger(t), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	c.metrics = newRequestMetrics()
	col := newClientCollector(c)

	// Before the start: both endpoints unreachable, no request sent.
	if v := endpointsGauge(t, col, "unreachable"); v != 2 {
		t.Errorf("unreachable endpoints before the start: %v, want 2", v)
	}
	if n := c.RequestCounts()["Status"]; n != 0 {
		t.Errorf("%d status requests before the start", n)
	}

	start, endStart := context.WithCancel(t.Context())
	if err := col.Start(start); err != nil {
		t.Fatal(err)
	}
	endStart()
	run := col.run.Load().ctx
	if run.Err() != nil {
		t.Fatal("the run ended with the start hook's context")
	}
	if err := col.Stop(t.Context()); err != nil {
		t.Fatal(err)
	}
	if run.Err() != nil {
		t.Fatal("the run ended before the client's stop path")
	}
	c.stop.Load().end()
	select {
	case <-run.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the run did not end with the client's stop path")
	}
}

// endpointsGauge collects col once and returns its
// identityd_kvstore_endpoints{state} sample.
func endpointsGauge(t *testing.T, col *clientCollector, state string) float64 {
	t.Helper()
	ch := make(chan prometheus.Metric)
	go func() { col.Collect(ch); close(ch) }()
	v := -1.0
	for m := range ch {
		if !strings.Contains(m.Desc().String(), `fqName: "identityd_kvstore_endpoints"`) {
			continue
		}
		var d dto.Metric
		if err := m.Write(&d); err != nil {
			t.Fatal(err)
		}
		if d.GetLabel()[0].GetValue() == state {
			v = d.GetGauge().GetValue()
		}
	}
	return v
}
