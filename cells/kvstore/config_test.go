package kvstore_test

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/spf13/pflag"

	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
)

func TestConfigValidate(t *testing.T) {
	valid := kvstore.DefaultConfig
	valid.NodeName = "node-1"
	tests := []struct {
		name    string
		change  func(*kvstore.Config)
		wantErr string // substring; empty: valid
	}{
		{"default", func(*kvstore.Config) {}, ""},
		{"external", func(c *kvstore.Config) { c.KVStoreEndpoints = []string{"https://10.0.0.1:2379"} }, ""},
		{"ttl minimum", func(c *kvstore.Config) { c.KVStoreLeaseTTL = 25 * time.Second }, ""},
		{"ttl maximum", func(c *kvstore.Config) { c.KVStoreLeaseTTL = 24 * time.Hour }, ""},
		{"ttl too short", func(c *kvstore.Config) { c.KVStoreLeaseTTL = 24 * time.Second }, "--kvstore-lease-ttl 24s is out of range: must be between 25s and 24h0m0s"},
		{"ttl too long", func(c *kvstore.Config) { c.KVStoreLeaseTTL = 25 * time.Hour }, "--kvstore-lease-ttl"},
		{"no dial timeout", func(c *kvstore.Config) { c.KVStoreDialTimeout = 0 }, "--kvstore-dial-timeout"},
		{"no request timeout", func(c *kvstore.Config) { c.KVStoreRequestTimeout = -time.Second }, "--kvstore-request-timeout"},
		{"negative rate", func(c *kvstore.Config) { c.KVStoreRateLimit = -1 }, "--kvstore-rate-limit"},
		{"slash in node name", func(c *kvstore.Config) { c.NodeName = "a/b" }, "must not contain '/'"},
		{"control char in node name", func(c *kvstore.Config) { c.NodeName = "a\nb" }, "control"},
		{"invalid utf8 node name", func(c *kvstore.Config) { c.NodeName = "a\xffb" }, "control"},
		{"semicolon in node name", func(c *kvstore.Config) { c.NodeName = "a;b" }, `--node-name "a;b" may hold only letters, digits, '-', '.' and '_'`},
		{"space in node name", func(c *kvstore.Config) { c.NodeName = "a b" }, `--node-name "a b" may hold only letters`},
		{"unicode in node name", func(c *kvstore.Config) { c.NodeName = "nöde" }, "may hold only letters"},
		{"node name ends in a dot", func(c *kvstore.Config) { c.NodeName = "node." }, "must start and end with a letter or digit"},
		{"node name starts with a dash", func(c *kvstore.Config) { c.NodeName = "-node" }, "must start and end with a letter or digit"},
		{"node name too long", func(c *kvstore.Config) { c.NodeName = strings.Repeat("n", 254) }, "longer than 253"},
		{"node name longest", func(c *kvstore.Config) { c.NodeName = strings.Repeat("n", 253) }, ""},
		{"host-like node name", func(c *kvstore.Config) { c.NodeName = "Worker_1.example-2.com" }, ""},
		{"bad endpoint", func(c *kvstore.Config) { c.KVStoreEndpoints = []string{"not a url"} }, "--kvstore-endpoints"},
		{"cert without key", func(c *kvstore.Config) {
			c.KVStoreEndpoints = []string{"https://h:1"}
			c.KVStoreCertFile = "c.pem"
		}, "must be given together"},
		{"user without password", func(c *kvstore.Config) {
			c.KVStoreEndpoints = []string{"http://h:1"}
			c.KVStoreUsername = "u"
		}, "--kvstore-password-file must be given together"},
		{"tls with embedded", func(c *kvstore.Config) { c.KVStoreCAFile = "ca.pem" }, "--kvstore-ca-file needs --kvstore-endpoints"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := valid
			tt.change(&cfg)
			err := cfg.Validate()
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("unexpected error: %v", err)
			case tt.wantErr != "" && err == nil:
				t.Fatalf("no error, want %q", tt.wantErr)
			case tt.wantErr != "" && !strings.Contains(err.Error(), tt.wantErr):
				t.Fatalf("error %q does not contain %q", err, tt.wantErr)
			}
		})
	}
}

// TestFlags checks that every config field has its flag and that flags
// reach the config, by running the cell's config through a hive.
func TestFlags(t *testing.T) {
	var got kvstore.Config
	h := hive.New(statedir.Cell, kvstore.Cell, cell.Invoke(func(c kvstore.Config) { got = c }))
	flags := pflag.NewFlagSet("test", pflag.ContinueOnError)
	h.RegisterFlags(flags)
	for _, name := range []string{
		"kvstore-endpoints", "kvstore-ca-file", "kvstore-cert-file", "kvstore-key-file",
		"kvstore-username", "kvstore-password-file", "kvstore-lease-ttl", "kvstore-dial-timeout",
		"kvstore-request-timeout", "kvstore-rate-limit", "node-name",
	} {
		if flags.Lookup(name) == nil {
			t.Errorf("flag --%s missing", name)
		}
	}
	if err := flags.Parse([]string{
		"--kvstore-endpoints=http://a:1,http://b:2", "--kvstore-lease-ttl=1m",
		"--kvstore-rate-limit=2.5", "--node-name=n1",
	}); err != nil {
		t.Fatal(err)
	}
	if err := h.Populate(hivetest.Logger(t)); err != nil {
		t.Fatal(err)
	}
	if len(got.KVStoreEndpoints) != 2 || got.KVStoreLeaseTTL != time.Minute || got.KVStoreRateLimit != 2.5 || got.NodeName != "n1" {
		t.Fatalf("flags not applied: %+v", got)
	}
}

// TestEmptyNodeNameIsHostName: the default --node-name is empty, so that
// --help states its default once, in words; the client and the
// identity.NodeName the stores get resolve it to the host name.
func TestEmptyNodeNameIsHostName(t *testing.T) {
	host, err := os.Hostname()
	if err != nil || kvstore.ValidateNodeName(host) != nil {
		t.Skipf("host name %q is no valid node name: %v", host, err)
	}
	if kvstore.DefaultConfig.NodeName != "" {
		t.Fatalf("default node name %q, want empty (the host name, resolved at start)", kvstore.DefaultConfig.NodeName)
	}
	cfg := kvstore.DefaultConfig
	if err := cfg.Validate(); err != nil {
		t.Fatalf("default config: %v", err)
	}
	cfg.KVStoreEndpoints = []string{"http://127.0.0.1:1"}
	c, err := kvstore.New(hivetest.Logger(t), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if c.NodeName() != host {
		t.Errorf("client's node name %q, want the host name %q", c.NodeName(), host)
	}

	var node identity.NodeName
	h := hive.New(statedir.Cell, kvstore.Cell, cell.Invoke(func(n identity.NodeName) { node = n }))
	flags := pflag.NewFlagSet("test", pflag.ContinueOnError)
	h.RegisterFlags(flags)
	if err := flags.Parse([]string{"--kvstore-endpoints=http://127.0.0.1:1"}); err != nil {
		t.Fatal(err)
	}
	if err := h.Populate(hivetest.Logger(t)); err != nil {
		t.Fatal(err)
	}
	if string(node) != host {
		t.Errorf("identity.NodeName %q, want the host name %q", node, host)
	}
	if def := flags.Lookup("node-name").DefValue; def != "" {
		t.Errorf("--node-name's default is %q; --help would show it beside \"(default: host name)\"", def)
	}
}
