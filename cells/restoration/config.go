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
	// means automatic: the hive's AutomaticGracePeriod, or
	// EmbeddedGracePeriod when it has none (in the identityd binary,
	// EmbeddedGracePeriod with the embedded etcd, ExternalGracePeriod with
	// external endpoints).
	IdentityRestoreGracePeriod time.Duration
}

// DefaultConfig is the default configuration: the automatic grace period.
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

// AutomaticGracePeriod is the grace period that
// --identity-restore-grace-period=0 stands for. A hive provides one when it
// knows how long the users of restored identities may take to come back;
// without one the restorer uses EmbeddedGracePeriod, which suits a hive
// whose identity users all run in the process (the embedded etcd, or no
// kvstore at all). The identityd binary provides
// AutomaticGracePeriodFor(external), external telling whether its kvstore
// has external endpoints. A provider, not an import of the kvstore cell,
// lets restoration be composed without the kvstore.
type AutomaticGracePeriod struct {
	// Period is the grace period; zero stands for EmbeddedGracePeriod,
	// as when the hive provides none.
	Period time.Duration
}

// AutomaticGracePeriodFor returns the automatic grace period for a hive
// whose kvstore has external endpoints (ExternalGracePeriod) or not
// (EmbeddedGracePeriod).
func AutomaticGracePeriodFor(externalKVStore bool) AutomaticGracePeriod {
	if externalKVStore {
		return AutomaticGracePeriod{Period: ExternalGracePeriod}
	}
	return AutomaticGracePeriod{Period: EmbeddedGracePeriod}
}

// gracePeriod resolves the automatic value: the hive's AutomaticGracePeriod
// (the zero value when it has none) or else EmbeddedGracePeriod.
func (c Config) gracePeriod(auto AutomaticGracePeriod) (time.Duration, error) {
	switch {
	case auto.Period < 0:
		return 0, fmt.Errorf("the automatic restoration grace period must not be negative, got %s", auto.Period)
	case c.IdentityRestoreGracePeriod > 0:
		return c.IdentityRestoreGracePeriod, nil
	case auto.Period == 0:
		return EmbeddedGracePeriod, nil
	default:
		return auto.Period, nil
	}
}
