package workloads

import (
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/spf13/pflag"
)

// The identity management modes (--identity-management-mode), Cilium's.
const (
	// ManagementModeAgent: each node allocates the identities of its own
	// pods (Cilium's default).
	ManagementModeAgent = "agent"
	// ManagementModeOperator: an identity manager creates the identities
	// of pods; each node adopts those of its own pods, and creates none.
	ManagementModeOperator = "operator"
	// ManagementModeBoth: nodes create as in agent mode while a manager
	// creates too, for the switch between the two.
	ManagementModeBoth = "both"
)

// Config is the workloads cell's configuration. The flag names and
// defaults are Cilium's.
type Config struct {
	// IdentityManagementMode says who creates the pods' identities:
	// ManagementModeAgent, ManagementModeOperator or ManagementModeBoth.
	IdentityManagementMode string
	// IdentityChangeGracePeriod is how long a pod's old identity is held
	// after the pod is deleted or its labels change, so that packets in
	// flight and peers that still know the old identity are not dropped.
	IdentityChangeGracePeriod time.Duration
	// LabelPrefixFile is Cilium's label prefix file; empty: Cilium's
	// default list.
	LabelPrefixFile string
	// Labels adds label prefixes to the default list or the file's.
	Labels []string
}

// DefaultConfig is Cilium's: agent mode, 5s grace, the default label list.
var DefaultConfig = Config{
	IdentityManagementMode:    ManagementModeAgent,
	IdentityChangeGracePeriod: 5 * time.Second,
}

// Flags registers the workloads cell's flags.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.String("identity-management-mode", def.IdentityManagementMode, "Who creates the identities of pods: agent (each node for its own pods), operator (an identity manager; nodes only adopt them) or both (nodes and a manager, while switching)")
	flags.Duration("identity-change-grace-period", def.IdentityChangeGracePeriod, "How long a pod's old identity is held after the pod is deleted or its labels change")
	flags.String("label-prefix-file", def.LabelPrefixFile, "Cilium's label prefix file (JSON, version 1): the prefixes of identity labels, instead of the default list")
	flags.StringSlice("labels", def.Labels, "Label prefixes added to the default list or the file's, [source:][!]regexp (! excludes)")
}

// ErrManagementMode: not an identity management mode.
var ErrManagementMode = errors.New("unsupported --identity-management-mode")

// Validate checks the configuration without reading files.
func (c Config) Validate() error {
	var errs []error
	switch c.IdentityManagementMode {
	case ManagementModeAgent, ManagementModeOperator, ManagementModeBoth:
	default:
		errs = append(errs, fmt.Errorf("%w %q: want %q, %q or %q",
			ErrManagementMode, c.IdentityManagementMode, ManagementModeAgent, ManagementModeOperator, ManagementModeBoth))
	}
	if c.IdentityChangeGracePeriod < 0 {
		errs = append(errs, fmt.Errorf("--identity-change-grace-period %s must not be negative", c.IdentityChangeGracePeriod))
	}
	return errors.Join(errs...)
}

// filter builds the label filter of --label-prefix-file and --labels.
func (c Config) filter() (*LabelFilter, error) {
	if c.LabelPrefixFile == "" {
		return NewLabelFilter(nil, c.Labels)
	}
	f, err := os.Open(c.LabelPrefixFile)
	if err != nil {
		return nil, fmt.Errorf("--label-prefix-file: %w", err)
	}
	defer f.Close()
	lf, err := NewLabelFilter(f, c.Labels)
	if err != nil {
		return nil, fmt.Errorf("--label-prefix-file %s: %w", c.LabelPrefixFile, err)
	}
	return lf, nil
}
