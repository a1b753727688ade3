package metrics

import (
	"fmt"
	"net"
	"strconv"

	"github.com/spf13/pflag"
)

// Config is the metrics cell's configuration.
type Config struct {
	// PrometheusServeAddr is the host:port of the /metrics, /healthz and
	// /readyz endpoint; empty disables the HTTP server (the registry still
	// exists). Port 0 picks a free port, which Server.Addr reports.
	PrometheusServeAddr string
}

// DefaultConfig serves on loopback only: metrics are not meant to be
// reachable from the network unless the operator says so.
var DefaultConfig = Config{
	PrometheusServeAddr: "127.0.0.1:9981",
}

// Flags registers the metrics flags.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.String("prometheus-serve-addr", def.PrometheusServeAddr,
		"Address (host:port) to serve Prometheus metrics on /metrics and health on /healthz (liveness) and /readyz (readiness); empty disables the endpoint")
}

// Validate checks the configuration.
func (c Config) Validate() error {
	if c.PrometheusServeAddr == "" {
		return nil
	}
	_, port, err := net.SplitHostPort(c.PrometheusServeAddr)
	if err != nil {
		return fmt.Errorf("invalid --prometheus-serve-addr %q: want host:port, e.g. 127.0.0.1:9981 or :9981: %w", c.PrometheusServeAddr, err)
	}
	// Service names ("http") would resolve, but a numeric port is what
	// scrape configs and firewall rules name, so ask for one.
	if _, err := strconv.ParseUint(port, 10, 16); err != nil {
		return fmt.Errorf("invalid --prometheus-serve-addr %q: port %q is not a number in 0..65535", c.PrometheusServeAddr, port)
	}
	return nil
}
