package restoration

import (
	"fmt"
	"time"

	"github.com/spf13/pflag"
)

// Grace periods chosen when --identity-restore-grace-period is left at 0.
const (
	// EmbeddedGracePeriod applies with the embedded etcd (or no kvstore):
	// every user of the restored identities runs in this process and
	// re-allocates them within seconds of the start.
	EmbeddedGracePeriod = 30 * time.Second
	// ExternalGracePeriod applies with external kvstore endpoints: the
	// state that re-creates the identities may come from a kvstore that
	// is slow to reach after a restart, as Cilium assumes too.
	ExternalGracePeriod = 10 * time.Minute
)

// Config is the restoration's configuration.
type Config struct {
	// IdentityRestoreGracePeriod is how long restored identities and
	// ipcache entries are held before the restorer lets go of them. 0
	// means automatic: EmbeddedGracePeriod with the embedded etcd or
	// without a kvstore, ExternalGracePeriod with external endpoints.
	IdentityRestoreGracePeriod time.Duration
}

// DefaultConfig is the default configuration: the grace period follows the
// kvstore mode.
var DefaultConfig = Config{IdentityRestoreGracePeriod: 0}

// Flags registers --identity-restore-grace-period.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.Duration("identity-restore-grace-period", def.IdentityRestoreGracePeriod,
		fmt.Sprintf("How long restored local identities and ipcache entries are kept before unused ones are released (0: %s with the embedded etcd, %s with external kvstore endpoints)",
			EmbeddedGracePeriod, ExternalGracePeriod))
}

// Validate checks the configuration.
func (c Config) Validate() error {
	if c.IdentityRestoreGracePeriod < 0 {
		return fmt.Errorf("--identity-restore-grace-period must not be negative, got %s", c.IdentityRestoreGracePeriod)
	}
	return nil
}

// gracePeriod resolves the automatic value. external says whether the
// kvstore uses external endpoints.
func (c Config) gracePeriod(external bool) time.Duration {
	switch {
	case c.IdentityRestoreGracePeriod > 0:
		return c.IdentityRestoreGracePeriod
	case external:
		return ExternalGracePeriod
	default:
		return EmbeddedGracePeriod
	}
}
