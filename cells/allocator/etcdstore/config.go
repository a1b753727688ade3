package etcdstore

import (
	"errors"
	"time"

	"github.com/spf13/pflag"
)

// Config configures what only the etcd store of global identities does;
// the settings it shares with the other stores (the first listing's bound,
// the garbage collection) are globalstore.Config's.
type Config struct {
	// KVStorePeriodicSync is the period at which this node checks that
	// its reference keys are in etcd as it wrote them, and writes the
	// missing ones again; 0 disables it.
	KVStorePeriodicSync time.Duration
}

// DefaultConfig is the default configuration of the etcd store.
var DefaultConfig = Config{
	KVStorePeriodicSync: 5 * time.Minute,
}

// Flags registers the flags of the etcd store.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.Duration("kvstore-periodic-sync", def.KVStorePeriodicSync, "Interval at which this node checks its identity reference keys in etcd and writes missing ones again; 0 disables it")
}

// Validate checks the configuration.
func (c Config) Validate() error {
	if c.KVStorePeriodicSync < 0 {
		return errors.New("--kvstore-periodic-sync must not be negative")
	}
	return nil
}
