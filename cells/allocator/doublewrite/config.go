package doublewrite

import (
	"errors"
	"time"

	"github.com/spf13/pflag"
)

// Config configures the double-write modes.
type Config struct {
	// DoubleWriteMetricReporterInterval is the period of the comparison
	// of the two stores (Cilium operator's option of that name); 0
	// disables it.
	DoubleWriteMetricReporterInterval time.Duration
}

// DefaultConfig is the default configuration: Cilium operator's.
var DefaultConfig = Config{DoubleWriteMetricReporterInterval: time.Minute}

// Flags registers the flags of the double-write modes.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.Duration("double-write-metric-reporter-interval", def.DoubleWriteMetricReporterInterval, "In the doublewrite-* identity allocation modes, period of the comparison of the global identities of etcd and of the CRDs on the node that collects, as Cilium operator's option of that name; 0 disables it")
}

// Validate checks the configuration.
func (c Config) Validate() error {
	if c.DoubleWriteMetricReporterInterval < 0 {
		return errors.New("--double-write-metric-reporter-interval must not be negative")
	}
	return nil
}
