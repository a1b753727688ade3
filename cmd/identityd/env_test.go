package main

import (
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/spf13/pflag"

	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/restoration"
	"github.com/identityd/identityd/cells/statedir"
)

// agentConfig populates an agent hive with the given flags and returns
// the configuration its cells see.
func agentConfig(t *testing.T, args ...string) (statedir.Config, kvstore.Config) {
	t.Helper()
	var dir statedir.Config
	var kv kvstore.Config
	h := newHive(cell.Invoke(func(d statedir.Config, k kvstore.Config) { dir, kv = d, k }))
	flags := pflag.NewFlagSet("agent", pflag.ContinueOnError)
	h.RegisterFlags(flags)
	if err := flags.Parse(args); err != nil {
		t.Fatal(err)
	}
	if err := h.Populate(hivetest.Logger(t)); err != nil {
		t.Fatal(err)
	}
	return dir, kv
}

// TestEnvironmentNeedsPrefix checks that only IDENTITYD_-prefixed variables
// set flags: NODE_NAME and STATE_DIR belong to other programs on a host.
func TestEnvironmentNeedsPrefix(t *testing.T) {
	t.Setenv("NODE_NAME", "from-plain-env")
	t.Setenv("STATE_DIR", "/plain/env")
	dir, kv := agentConfig(t)
	if dir.StateDir != statedir.DefaultConfig.StateDir || kv.NodeName != kvstore.DefaultConfig.NodeName {
		t.Fatalf("unprefixed variables were read: state dir %q, node name %q", dir.StateDir, kv.NodeName)
	}

	t.Setenv("IDENTITYD_NODE_NAME", "from-prefixed-env")
	t.Setenv("IDENTITYD_STATE_DIR", "/prefixed/env")
	dir, kv = agentConfig(t)
	if dir.StateDir != "/prefixed/env" || kv.NodeName != "from-prefixed-env" {
		t.Fatalf("prefixed variables not read: state dir %q, node name %q", dir.StateDir, kv.NodeName)
	}

	// A flag wins over the environment.
	dir, kv = agentConfig(t, "--node-name", "from-flag", "--state-dir", "/from/flag")
	if dir.StateDir != "/from/flag" || kv.NodeName != "from-flag" {
		t.Fatalf("flags lost to the environment: state dir %q, node name %q", dir.StateDir, kv.NodeName)
	}
}

// TestAutomaticGracePeriod checks the agent's automatic restoration grace
// period: 30s with the embedded etcd, 10m with external kvstore endpoints,
// and what --identity-restore-grace-period says when it is set.
func TestAutomaticGracePeriod(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want time.Duration
	}{
		{nil, 30 * time.Second},
		{[]string{"--kvstore-endpoints", "https://127.0.0.1:1"}, 10 * time.Minute},
		{[]string{"--kvstore-endpoints", "https://127.0.0.1:1", "--identity-restore-grace-period", "45s"}, 45 * time.Second},
		{[]string{"--identity-restore-grace-period", "2m"}, 2 * time.Minute},
	} {
		var got time.Duration
		h := newHive(cell.Invoke(func(r *restoration.Restorer) { got = r.GracePeriod() }))
		flags := pflag.NewFlagSet("agent", pflag.ContinueOnError)
		h.RegisterFlags(flags)
		if err := flags.Parse(append([]string{"--state-dir", t.TempDir(), "--ipcache-map", "file"}, tc.args...)); err != nil {
			t.Fatal(err)
		}
		if err := h.Populate(hivetest.Logger(t)); err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		if got != tc.want {
			t.Errorf("%v: grace period %s, want %s", tc.args, got, tc.want)
		}
	}
}
