package etcdstore

import (
	"errors"
	"time"

	"github.com/spf13/pflag"
)

// Config configures the etcd store of global identities.
type Config struct {
	// AllocatorListTimeout bounds how long the allocator's start waits
	// for the first listing of global identities; the listing goes on in
	// the background after it.
	AllocatorListTimeout time.Duration
	// IdentityGCInterval is the period of the garbage collection of
	// unused master keys; 0 disables it.
	IdentityGCInterval time.Duration
	// IdentityGCRateLimit is the most master keys deleted per
	// IdentityGCRateInterval.
	IdentityGCRateLimit int64
	// IdentityGCRateInterval is the window of IdentityGCRateLimit.
	IdentityGCRateInterval time.Duration
	// KVStorePeriodicSync is the period at which this node checks that
	// its reference keys are in etcd as it wrote them, and writes the
	// missing ones again; 0 disables it.
	KVStorePeriodicSync time.Duration
}

// DefaultConfig is the default configuration of the etcd store.
var DefaultConfig = Config{
	AllocatorListTimeout:   3 * time.Minute,
	IdentityGCInterval:     15 * time.Minute,
	IdentityGCRateLimit:    2500,
	IdentityGCRateInterval: time.Minute,
	KVStorePeriodicSync:    5 * time.Minute,
}

// Flags registers the flags of the etcd store.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.Duration("allocator-list-timeout", def.AllocatorListTimeout, "Time the start waits for the first listing of global identities from etcd (listing continues in the background)")
	flags.Duration("identity-gc-interval", def.IdentityGCInterval, "Interval of the garbage collection of unused global identities in etcd; 0 disables it")
	flags.Int64("identity-gc-rate-limit", def.IdentityGCRateLimit, "Maximum number of global identities deleted by the garbage collection per --identity-gc-rate-interval")
	flags.Duration("identity-gc-rate-interval", def.IdentityGCRateInterval, "Window of --identity-gc-rate-limit")
	flags.Duration("kvstore-periodic-sync", def.KVStorePeriodicSync, "Interval at which this node checks its identity reference keys in etcd and writes missing ones again; 0 disables it")
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
	case c.KVStorePeriodicSync < 0:
		return errors.New("--kvstore-periodic-sync must not be negative")
	}
	return nil
}
