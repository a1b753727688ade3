package globalstore

import (
	"errors"
	"time"

	"github.com/spf13/pflag"
)

// Config holds the settings every store of global identities shares. The
// allocator cell registers its flags once, and each driver cell takes it
// from the hive.
type Config struct {
	// AllocatorListTimeout bounds how long the allocator's start waits
	// for the first listing of global identities; the listing goes on in
	// the background after it.
	AllocatorListTimeout time.Duration
	// IdentityGCInterval is the period of the garbage collection of
	// unused global identities; 0 disables it.
	IdentityGCInterval time.Duration
	// IdentityGCRateLimit is the most global identities deleted per
	// IdentityGCRateInterval.
	IdentityGCRateLimit int64
	// IdentityGCRateInterval is the window of IdentityGCRateLimit.
	IdentityGCRateInterval time.Duration
	// IdentityHeartbeatTimeout is how long an unused identity of the CRD
	// store carries its deletion mark before the garbage collection may
	// delete it (Cilium operator's --identity-heartbeat-timeout). The etcd
	// store deletes an unused master key in one guarded transaction and
	// does not use it.
	IdentityHeartbeatTimeout time.Duration
}

// DefaultConfig is the default configuration shared by the stores.
var DefaultConfig = Config{
	AllocatorListTimeout:     3 * time.Minute,
	IdentityGCInterval:       15 * time.Minute,
	IdentityGCRateLimit:      2500,
	IdentityGCRateInterval:   time.Minute,
	IdentityHeartbeatTimeout: 30 * time.Minute,
}

// Flags registers the flags shared by the stores of global identities.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.Duration("allocator-list-timeout", def.AllocatorListTimeout, "Time the start waits for the first listing of global identities from the store (listing continues in the background)")
	flags.Duration("identity-gc-interval", def.IdentityGCInterval, "Interval of the garbage collection of unused global identities in the store; 0 disables it")
	flags.Int64("identity-gc-rate-limit", def.IdentityGCRateLimit, "Maximum number of global identities deleted by the garbage collection per --identity-gc-rate-interval")
	flags.Duration("identity-gc-rate-interval", def.IdentityGCRateInterval, "Window of --identity-gc-rate-limit")
	flags.Duration("identity-heartbeat-timeout", def.IdentityHeartbeatTimeout, "Time an unused CiliumIdentity carries its heartbeat mark before the garbage collection deletes it, as Cilium operator's option of that name (crd mode; the kvstore mode ignores it)")
}

// Validate checks the configuration.
func (c Config) Validate() error {
	switch {
	case c.AllocatorListTimeout <= 0:
		return errors.New("--allocator-list-timeout must be positive")
	case c.IdentityGCInterval < 0:
		return errors.New("--identity-gc-interval must not be negative")
	case c.IdentityGCRateLimit <= 0:
		return errors.New("--identity-gc-rate-limit must be positive")
	case c.IdentityGCRateInterval <= 0:
		return errors.New("--identity-gc-rate-interval must be positive")
	case c.IdentityHeartbeatTimeout <= 0:
		return errors.New("--identity-heartbeat-timeout must be positive")
	}
	return nil
}

// AdoptOnly, when the hive provides it true, says that this node writes
// no global identity: it adopts those another writer (the identity
// manager of --identity-management-mode=operator) created and holds, and
// leaves heartbeat marks and the re-creation of deleted identities to
// that writer, so that it needs only read access to them. The workloads
// cell provides it from the management mode.
type AdoptOnly bool
