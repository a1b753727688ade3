package crdstore

import (
	"fmt"
	"time"

	"github.com/spf13/pflag"
)

// MinIdentityNodeLeaseTTL is the shortest --identity-node-lease-ttl: the
// record is renewed every third of it, and a renewal must have room for a
// slow API server's answer.
const MinIdentityNodeLeaseTTL = 25 * time.Second

// Config configures the CRD store of global identities.
type Config struct {
	// IdentityNodeLeaseTTL is how long this node's IdentityNode record
	// counts after its last renewal; it is renewed every third of it. A
	// node that stops renewing (killed, cut off) stops protecting its
	// identities once it ends.
	IdentityNodeLeaseTTL time.Duration
}

// DefaultConfig is the default configuration of the CRD store.
var DefaultConfig = Config{
	IdentityNodeLeaseTTL: 15 * time.Minute,
}

// Flags registers the flags of the CRD store.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.Duration("identity-node-lease-ttl", def.IdentityNodeLeaseTTL,
		"How long this node's IdentityNode record of the global identities it uses counts after its last renewal (renewed every third of it; at least 25s)")
}

// Validate checks the configuration.
func (c Config) Validate() error {
	if c.IdentityNodeLeaseTTL < MinIdentityNodeLeaseTTL {
		return fmt.Errorf("--identity-node-lease-ttl must be at least %s, not %s", MinIdentityNodeLeaseTTL, c.IdentityNodeLeaseTTL)
	}
	return nil
}
