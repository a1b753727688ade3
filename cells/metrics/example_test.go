package metrics_test

import (
	"bufio"
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"strings"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"

	"github.com/identityd/identityd/cells/metrics"
)

// A cell contributes its collectors to the hive's registry, and the
// endpoint serves them; port 0 picks a free port.
func Example() {
	requests := prometheus.NewCounter(prometheus.CounterOpts{Name: "myagent_requests_total", Help: "Requests served."})
	var srv *metrics.Server
	h := hive.New(job.Cell, metrics.Cell,
		cell.Provide(func() metrics.CollectorOut { return metrics.NewCollector(requests) }),
		cell.Invoke(func(s *metrics.Server) { srv = s }))
	fs := pflag.NewFlagSet("agent", pflag.ContinueOnError)
	h.RegisterFlags(fs)
	fs.Set("prometheus-serve-addr", "127.0.0.1:0")
	log := slog.New(slog.DiscardHandler)
	ctx := context.Background()
	if err := h.Start(log, ctx); err != nil {
		panic(err)
	}
	defer h.Stop(log, ctx)

	requests.Add(3)
	resp, err := http.Get("http://" + srv.Addr() + "/metrics")
	if err != nil {
		panic(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), "myagent_") {
			fmt.Println(sc.Text())
		}
	}
	// Output:
	// myagent_requests_total 3
}
