package workloads

import (
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/spf13/pflag"
)

// ManagementModeAgent is the identity management mode in which each node
// allocates the identities of its own pods (Cilium's default).
const ManagementModeAgent = "agent"

// Config is the workloads cell's configuration. The flag names and
// defaults are Cilium's.
type Config struct {
	// IdentityManagementMode says who allocates the pods' identities;
	// agent (each node for its own pods) is the only mode served.
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
	flags.String("identity-management-mode", def.IdentityManagementMode, "Who allocates the identities of pods: agent (each node for its own pods; the only mode served)")
	flags.Duration("identity-change-grace-period", def.IdentityChangeGracePeriod, "How long a pod's old identity is held after the pod is deleted or its labels change")
	flags.String("label-prefix-file", def.LabelPrefixFile, "Cilium's label prefix file (JSON, version 1): the prefixes of identity labels, instead of the default list")
	flags.StringSlice("labels", def.Labels, "Label prefixes added to the default list or the file's, [source:][!]regexp (! excludes)")
}

// ErrManagementMode: an identity management mode this cell does not serve.
var ErrManagementMode = errors.New("unsupported --identity-management-mode")

// Validate checks the configuration without reading files.
func (c Config) Validate() error {
	var errs []error
	if c.IdentityManagementMode != ManagementModeAgent {
		errs = append(errs, fmt.Errorf("%w %q: only %q is served (each node allocates its own pods' identities); operator and both are not implemented",
			ErrManagementMode, c.IdentityManagementMode, ManagementModeAgent))
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
