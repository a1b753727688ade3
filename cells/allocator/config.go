package allocator

import (
	"errors"
	"fmt"
	"time"

	"github.com/spf13/pflag"

	"github.com/identityd/identityd/identity"
)

// Config is the allocator's configuration.
type Config struct {
	// ClusterID is this cluster's ID in a cluster mesh (0..max-connected-clusters).
	ClusterID uint32
	// ClusterName is this cluster's name.
	ClusterName string
	// MaxConnectedClusters is the size of the cluster mesh: 255 or 511.
	MaxConnectedClusters uint32
	// IdentityAllocationTimeout bounds every allocator call that may wait
	// on the kvstore.
	IdentityAllocationTimeout time.Duration
}

// DefaultConfig is the default configuration.
var DefaultConfig = Config{
	ClusterID:                 0,
	ClusterName:               identity.DefaultClusterName,
	MaxConnectedClusters:      identity.MaxConnectedClusters255,
	IdentityAllocationTimeout: 2 * time.Minute,
}

// Flags registers the allocator's flags.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.Uint32("cluster-id", def.ClusterID, "Unique ID of this cluster in a cluster mesh (0 .. max-connected-clusters); selects its global identity range")
	flags.String("cluster-name", def.ClusterName, "Name of this cluster; must not be \"default\" when --cluster-id is non-zero")
	flags.Uint32("max-connected-clusters", def.MaxConnectedClusters, "Largest number of clusters in the mesh: 255 or 511 (changes the global identity ranges)")
	flags.Duration("identity-allocation-timeout", def.IdentityAllocationTimeout, "Bound on every identity allocation or release that waits for the kvstore")
}

// ClusterInfo returns the cluster part of the configuration.
func (c Config) ClusterInfo() identity.ClusterInfo {
	return identity.ClusterInfo{ID: c.ClusterID, Name: c.ClusterName, MaxConnectedClusters: c.MaxConnectedClusters}
}

// Validate checks the configuration.
func (c Config) Validate() error {
	if err := c.ClusterInfo().Validate(); err != nil {
		return fmt.Errorf("invalid cluster configuration: %w", err)
	}
	if c.IdentityAllocationTimeout <= 0 {
		return errors.New("--identity-allocation-timeout must be positive")
	}
	return nil
}
