package checkpoint

import (
	"fmt"
	"time"

	"github.com/spf13/pflag"
)

// Config is the checkpoint's configuration.
type Config struct {
	// IdentityCheckpointInterval is the shortest time between two
	// checkpoint writes triggered by allocator changes. 0 writes on every
	// change.
	IdentityCheckpointInterval time.Duration
}

// DefaultConfig is the default configuration: at most one write per 10s,
// as Cilium does, which bounds the disk traffic of a churning node while
// losing at most 10s of changes on a crash.
var DefaultConfig = Config{IdentityCheckpointInterval: 10 * time.Second}

// Flags registers --identity-checkpoint-interval.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.Duration("identity-checkpoint-interval", def.IdentityCheckpointInterval,
		"Minimum interval between two writes of the local identity checkpoint (0 writes on every change)")
}

// Validate checks the configuration.
func (c Config) Validate() error {
	if c.IdentityCheckpointInterval < 0 {
		return fmt.Errorf("--identity-checkpoint-interval must not be negative, got %s", c.IdentityCheckpointInterval)
	}
	return nil
}
