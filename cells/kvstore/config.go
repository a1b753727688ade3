package kvstore

import (
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"time"
	"unicode"

	"github.com/spf13/pflag"
)

// Bounds of --kvstore-lease-ttl. Below 25s a keepalive round trip under load
// may not fit in the lease's life; above a day a crashed node's references
// would linger for too long.
const (
	MinLeaseTTL = 25 * time.Second
	MaxLeaseTTL = 24 * time.Hour
)

// Config is the kvstore cell's configuration.
type Config struct {
	// KVStoreEndpoints are the etcd client URLs. Empty runs an embedded
	// etcd in <state-dir>/etcd.
	KVStoreEndpoints []string
	// KVStoreCAFile is the CA bundle that verifies the servers.
	KVStoreCAFile string
	// KVStoreCertFile and KVStoreKeyFile are the client certificate and
	// key presented to the servers.
	KVStoreCertFile string
	KVStoreKeyFile  string
	// KVStoreUsername is the etcd user; its password is read from
	// KVStorePasswordFile so that it never shows in the process list.
	KVStoreUsername     string
	KVStorePasswordFile string
	// KVStoreLeaseTTL is the TTL of the node's data lease: how long this
	// node's reference keys outlive it when it dies without stopping.
	KVStoreLeaseTTL time.Duration
	// KVStoreDialTimeout bounds connecting to etcd at start.
	KVStoreDialTimeout time.Duration
	// KVStoreRequestTimeout is the timeout callers should give one request.
	KVStoreRequestTimeout time.Duration
	// KVStoreRateLimit caps this client's KV requests per second; 0 is no
	// limit.
	KVStoreRateLimit float64
	// NodeName is this node's name, the suffix of its reference keys;
	// empty means the host name (resolved by New and Validate, so that
	// --help states the default once, in words, instead of the name of
	// the machine that printed it).
	NodeName string
}

// DefaultConfig is the default configuration.
var DefaultConfig = Config{
	KVStoreLeaseTTL:       15 * time.Minute,
	KVStoreDialTimeout:    15 * time.Second,
	KVStoreRequestTimeout: 30 * time.Second,
}

// nodeName is c.NodeName, or the host name when it is empty ("" when the
// host name is unknown, which Validate reports).
func (c Config) nodeName() string {
	if c.NodeName != "" {
		return c.NodeName
	}
	name, err := os.Hostname()
	if err != nil {
		return ""
	}
	return name
}

// Flags registers the --kvstore-* and --node-name flags.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.StringSlice("kvstore-endpoints", def.KVStoreEndpoints, "etcd client URLs (comma-separated); empty runs an embedded etcd in <state-dir>/etcd")
	flags.String("kvstore-ca-file", def.KVStoreCAFile, "CA bundle (PEM) that verifies the etcd servers")
	flags.String("kvstore-cert-file", def.KVStoreCertFile, "Client certificate (PEM) presented to etcd")
	flags.String("kvstore-key-file", def.KVStoreKeyFile, "Key (PEM) of --kvstore-cert-file")
	flags.String("kvstore-username", def.KVStoreUsername, "etcd user name")
	flags.String("kvstore-password-file", def.KVStorePasswordFile, "File holding the password of --kvstore-username")
	flags.Duration("kvstore-lease-ttl", def.KVStoreLeaseTTL, "TTL of this node's etcd lease: how long its keys survive it after a crash (25s..24h)")
	flags.Duration("kvstore-dial-timeout", def.KVStoreDialTimeout, "Time allowed to reach etcd at start")
	flags.Duration("kvstore-request-timeout", def.KVStoreRequestTimeout, "Timeout of a single etcd request")
	flags.Float64("kvstore-rate-limit", def.KVStoreRateLimit, "Maximum etcd KV requests per second from this node; 0 means unlimited")
	flags.String("node-name", def.NodeName, "Name of this node in etcd keys (default: host name)")
}

// Embedded reports whether the configuration asks for the embedded etcd.
func (c Config) Embedded() bool { return len(c.KVStoreEndpoints) == 0 }

// Validate checks the configuration without touching files or network.
func (c Config) Validate() error {
	var errs []error
	if c.KVStoreLeaseTTL < MinLeaseTTL || c.KVStoreLeaseTTL > MaxLeaseTTL {
		errs = append(errs, fmt.Errorf("--kvstore-lease-ttl %s is out of range: must be between %s and %s", c.KVStoreLeaseTTL, MinLeaseTTL, MaxLeaseTTL))
	}
	if c.KVStoreDialTimeout <= 0 {
		errs = append(errs, fmt.Errorf("--kvstore-dial-timeout %s must be positive", c.KVStoreDialTimeout))
	}
	if c.KVStoreRequestTimeout <= 0 {
		errs = append(errs, fmt.Errorf("--kvstore-request-timeout %s must be positive", c.KVStoreRequestTimeout))
	}
	if c.KVStoreRateLimit < 0 {
		errs = append(errs, fmt.Errorf("--kvstore-rate-limit %g must not be negative", c.KVStoreRateLimit))
	}
	if err := ValidateNodeName(c.nodeName()); err != nil {
		errs = append(errs, err)
	}
	for _, ep := range c.KVStoreEndpoints {
		u, err := url.Parse(ep)
		if err != nil || u.Host == "" && u.Scheme != "unix" && u.Scheme != "unixs" {
			errs = append(errs, fmt.Errorf("--kvstore-endpoints: %q is not a URL like http://host:port", ep))
		}
	}
	if (c.KVStoreCertFile == "") != (c.KVStoreKeyFile == "") {
		errs = append(errs, errors.New("--kvstore-cert-file and --kvstore-key-file must be given together"))
	}
	if (c.KVStoreUsername == "") != (c.KVStorePasswordFile == "") {
		errs = append(errs, errors.New("--kvstore-username and --kvstore-password-file must be given together"))
	}
	if c.Embedded() {
		// The embedded etcd makes its own certificates and needs no auth:
		// such settings would be silently ignored, which hides mistakes.
		for _, f := range []struct{ flag, value string }{
			{"--kvstore-ca-file", c.KVStoreCAFile},
			{"--kvstore-cert-file", c.KVStoreCertFile},
			{"--kvstore-username", c.KVStoreUsername},
		} {
			if f.value != "" {
				errs = append(errs, fmt.Errorf("%s needs --kvstore-endpoints (the embedded etcd uses certificates of its own in <state-dir>/etcd-tls)", f.flag))
			}
		}
	}
	return errors.Join(errs...)
}

// MaxNodeNameLength is the longest --node-name: a Kubernetes object name's
// limit, since in crd mode the name is also the IdentityNode's.
const MaxNodeNameLength = 253

// ValidateNodeName checks that name can be a node name in every store: the
// last element of etcd reference keys, and the name of an IdentityNode
// object. It may hold ASCII letters, digits, '-', '.' and '_', at most
// MaxNodeNameLength of them, and starts and ends with a letter or digit,
// as host names and Kubernetes node names do. (In crd mode the name must
// also be lower case; see ValidateObjectNodeName.)
func ValidateNodeName(name string) error {
	switch {
	case name == "":
		return errors.New("--node-name must not be empty (and the host name is unknown)")
	case strings.Contains(name, "/"):
		return fmt.Errorf("--node-name %q must not contain '/'", name)
	}
	for _, r := range name {
		if unicode.IsControl(r) || !unicode.IsPrint(r) || r == utf8RuneError {
			return fmt.Errorf("--node-name %q must not contain control or non-printable characters", name)
		}
	}
	if len(name) > MaxNodeNameLength {
		return fmt.Errorf("--node-name of %d characters is longer than %d", len(name), MaxNodeNameLength)
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		alnum := 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9'
		edge := i == 0 || i == len(name)-1
		if !alnum && (edge || (c != '-' && c != '.' && c != '_')) {
			return fmt.Errorf("--node-name %q may hold only letters, digits, '-', '.' and '_', and must start and end with a letter or digit (it ends etcd reference keys and names this node's IdentityNode object)", name)
		}
	}
	return nil
}

// ValidateObjectNodeName checks what crd mode needs of a node name beyond
// ValidateNodeName: the IdentityNode object's name must be a DNS subdomain
// name (RFC 1123), so lower case and no '_', as Kubernetes node names are.
func ValidateObjectNodeName(name string) error {
	if err := ValidateNodeName(name); err != nil {
		return err
	}
	if strings.ToLower(name) != name || strings.Contains(name, "_") {
		return fmt.Errorf("--node-name %q must be lower case and hold no '_' in crd mode: it names this node's IdentityNode object (a Kubernetes node name, as spec.nodeName gives it, always is)", name)
	}
	return nil
}

const utf8RuneError = '\uFFFD'
