package workloads

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestConfigValidate(t *testing.T) {
	if err := DefaultConfig.Validate(); err != nil {
		t.Fatalf("default config: %v", err)
	}
	for _, mode := range []string{"operator", "both"} {
		c := DefaultConfig
		c.IdentityManagementMode = mode
		if err := c.Validate(); err != nil {
			t.Errorf("mode %q: %v", mode, err)
		}
	}
	for _, mode := range []string{"", "Agent", "operators"} {
		c := DefaultConfig
		c.IdentityManagementMode = mode
		err := c.Validate()
		if !errors.Is(err, ErrManagementMode) || !strings.Contains(err.Error(), `want "agent", "operator" or "both"`) {
			t.Errorf("mode %q: %v, want ErrManagementMode naming the modes", mode, err)
		}
	}
	c := DefaultConfig
	c.IdentityChangeGracePeriod = -time.Second
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "--identity-change-grace-period") {
		t.Errorf("negative grace period: %v", err)
	}
	c.IdentityChangeGracePeriod = 0 // release at once: allowed
	if err := c.Validate(); err != nil {
		t.Errorf("zero grace period: %v", err)
	}
}

func TestConfigFilter(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "prefixes.json")
	if err := os.WriteFile(good, []byte(`{"version": 1, "valid-prefixes": [{"source": "k8s", "prefix": "app"}]}`), 0o600); err != nil {
		t.Fatal(err)
	}
	bad := filepath.Join(dir, "bad.json")
	if err := os.WriteFile(bad, []byte(`{"version": 2}`), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		file   string
		labels []string
		want   string // error text, "" for none
	}{
		{name: "default list"},
		{name: "file", file: good},
		{name: "file and labels", file: good, labels: []string{"k8s:!team"}},
		{name: "missing file", file: filepath.Join(dir, "none.json"), want: "--label-prefix-file"},
		{name: "bad file", file: bad, want: "unsupported version 2"},
		{name: "bad label prefix", labels: []string{"k8s:("}, want: "invalid label prefix"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := DefaultConfig
			c.LabelPrefixFile, c.Labels = tc.file, tc.labels
			f, err := c.filter()
			switch {
			case tc.want == "" && (err != nil || f == nil):
				t.Fatalf("filter: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("filter: %v, want an error with %q", err, tc.want)
			}
		})
	}
}

// TestManagerConfigValidate: the election's timings are checked as
// client-go checks them, so that a bad one fails the start with the flag's
// name instead of a panic in the election.
func TestManagerConfigValidate(t *testing.T) {
	if err := DefaultManagerConfig.Validate(); err != nil {
		t.Fatalf("default: %v", err)
	}
	for flag, change := range map[string]func(*ManagerConfig){
		"--identity-manager-lease-namespace": func(c *ManagerConfig) { c.IdentityManagerLeaseNamespace = "" },
		"--leader-election-retry-period":     func(c *ManagerConfig) { c.LeaderElectionRetryPeriod = 0 },
		"--leader-election-renew-deadline":   func(c *ManagerConfig) { c.LeaderElectionRenewDeadline = c.LeaderElectionRetryPeriod },
		"--leader-election-lease-duration":   func(c *ManagerConfig) { c.LeaderElectionLeaseDuration = c.LeaderElectionRenewDeadline },
	} {
		c := DefaultManagerConfig
		change(&c)
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), flag) {
			t.Errorf("%s: %v, want an error naming it", flag, err)
		}
	}
}
