package metrics

import (
	"fmt"

	"github.com/cilium/hive/cell"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// Cell provides the hive's *prometheus.Registry and serves it with the
// health of every module on --prometheus-serve-addr. Other cells contribute
// collectors with CollectorOut.
var Cell = cell.Module(
	"metrics",
	"Prometheus metrics and health endpoint",

	cell.Config(DefaultConfig),
	cell.Provide(
		newRegistry,
		newServer,
	),
	// The server is constructed on its own first, before the registry
	// pulls in the cells whose collectors it gathers: its start hook is
	// then appended before theirs, so metrics and health are served
	// while the other cells start, and until they have stopped.
	cell.Invoke(func(*Server) {}),
	cell.Invoke(func(s *Server, reg *prometheus.Registry) { s.serveRegistry(reg) }),
)

// CollectorGroup is the value group through which cells contribute
// collectors to the registry.
const CollectorGroup = "identityd-metrics"

// CollectorOut contributes a collector to the hive's registry. Return it
// from a constructor given to cell.Provide. A nil Collector is skipped, so a
// cell can contribute conditionally.
type CollectorOut struct {
	cell.Out

	Collector prometheus.Collector `group:"identityd-metrics"`
}

// NewCollector returns a CollectorOut for c.
func NewCollector(c prometheus.Collector) CollectorOut { return CollectorOut{Collector: c} }

type registryParams struct {
	cell.In

	Collectors []prometheus.Collector `group:"identityd-metrics"`
}

// newRegistry builds the hive's own registry. Using one per hive instead of
// prometheus.DefaultRegisterer is what lets two hives live in one process
// (tests, an agent embedding the cells twice) without duplicate-registration
// panics or mixed-up values.
func newRegistry(p registryParams) (*prometheus.Registry, error) {
	reg := prometheus.NewRegistry()
	cs := append([]prometheus.Collector{
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	}, p.Collectors...)
	for _, c := range cs {
		if c == nil {
			continue
		}
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("metrics: registering collector %T: %w", c, err)
		}
	}
	return reg, nil
}
