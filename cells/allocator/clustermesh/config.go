package clustermesh

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/spf13/pflag"
	"go.yaml.in/yaml/v3"

	"github.com/identityd/identityd/identity"
)

// Config configures the remote clusters whose identities this
// node follows.
type Config struct {
	// ClusterMeshConfig is a directory with one file per remote cluster,
	// named after the cluster (see RemoteClusterConfig). Empty follows no
	// remote cluster.
	ClusterMeshConfig string
	// ClusterMeshRemoteTimeout is how long a remote cluster may be
	// unreachable before its identities are withdrawn.
	ClusterMeshRemoteTimeout time.Duration
}

// DefaultConfig is the default: no remote clusters, identities
// of an unreachable one withdrawn after 5 minutes.
var DefaultConfig = Config{
	ClusterMeshRemoteTimeout: 5 * time.Minute,
}

// Flags registers the --clustermesh-* flags.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.String("clustermesh-config", def.ClusterMeshConfig, "Directory with one file per remote cluster (file name = cluster name; YAML with endpoints, cluster-id, TLS and auth settings); polled every second")
	flags.Duration("clustermesh-remote-timeout", def.ClusterMeshRemoteTimeout, "Time a remote cluster may be unreachable before its identities are withdrawn")
}

// Validate checks the configuration.
func (c Config) Validate() error {
	if c.ClusterMeshRemoteTimeout <= 0 {
		return errors.New("--clustermesh-remote-timeout must be positive")
	}
	return nil
}

// clusterMeshPollInterval is how often the --clustermesh-config directory is
// read. Polling sees every kind of change alike (Kubernetes replaces
// mounted secrets by swapping a symlink, which file watches report
// unreliably), and the directory holds a handful of small files.
const clusterMeshPollInterval = time.Second

// RemoteClusterConfig is the content of one file of the --clustermesh-config
// directory, in YAML:
//
//	endpoints:                  # etcd client URLs of the remote cluster (required)
//	  - https://c2-etcd.example:2379
//	cluster-id: 2               # the remote cluster's ID (required, 1..max-connected-clusters)
//	ca-file: c2-ca.crt          # CA bundle that verifies its servers (alias: trusted-ca-file)
//	cert-file: c2-client.crt    # client certificate and key, given together
//	key-file: c2-client.key
//	username: identityd         # etcd user, with the file holding its password
//	password-file: c2-password
//
// Relative paths are relative to the directory. The file's name is the
// remote cluster's name.
type RemoteClusterConfig struct {
	Endpoints     []string `yaml:"endpoints"`
	ClusterID     uint32   `yaml:"cluster-id"`
	CAFile        string   `yaml:"ca-file"`
	TrustedCAFile string   `yaml:"trusted-ca-file"`
	CertFile      string   `yaml:"cert-file"`
	KeyFile       string   `yaml:"key-file"`
	Username      string   `yaml:"username"`
	PasswordFile  string   `yaml:"password-file"`
}

// ParseRemoteClusterConfig parses and checks one remote cluster's file.
// Relative paths are made relative to dir.
func ParseRemoteClusterConfig(data []byte, dir string) (RemoteClusterConfig, error) {
	var c RemoteClusterConfig
	dec := yaml.NewDecoder(bytes.NewReader(data))
	// Unknown keys are errors: a misspelt "cert-file" would otherwise
	// connect without the certificate and fail in a confusing way.
	dec.KnownFields(true)
	if err := dec.Decode(&c); err != nil {
		if errors.Is(err, io.EOF) {
			return c, errors.New("empty file")
		}
		return c, fmt.Errorf("invalid YAML: %w", err)
	}
	if c.CAFile == "" {
		c.CAFile = c.TrustedCAFile
	} else if c.TrustedCAFile != "" && c.TrustedCAFile != c.CAFile {
		return c, errors.New("ca-file and trusted-ca-file differ")
	}
	c.TrustedCAFile = ""
	if len(c.Endpoints) == 0 {
		return c, errors.New("no endpoints")
	}
	for _, ep := range c.Endpoints {
		u, err := url.Parse(ep)
		if err != nil || u.Host == "" && u.Scheme != "unix" && u.Scheme != "unixs" {
			return c, fmt.Errorf("endpoint %q is not a URL like https://host:port", ep)
		}
	}
	if c.ClusterID == 0 {
		return c, errors.New("cluster-id is missing or 0 (a remote cluster needs a non-zero ID)")
	}
	if (c.CertFile == "") != (c.KeyFile == "") {
		return c, errors.New("cert-file and key-file must be given together")
	}
	if (c.Username == "") != (c.PasswordFile == "") {
		return c, errors.New("username and password-file must be given together")
	}
	for _, p := range []*string{&c.CAFile, &c.CertFile, &c.KeyFile, &c.PasswordFile} {
		if *p != "" && !filepath.IsAbs(*p) {
			*p = filepath.Join(dir, *p)
		}
	}
	return c, nil
}

// validateRemote checks a remote cluster's name and ID against this
// cluster's configuration.
func validateRemote(name string, c RemoteClusterConfig, local identity.ClusterInfo) error {
	if err := identity.ValidateClusterName(name); err != nil {
		return err
	}
	if name == identity.DefaultClusterName {
		return fmt.Errorf("%w: a remote cluster cannot be named %q", identity.ErrInvalidClusterName, name)
	}
	remote := identity.ClusterInfo{ID: c.ClusterID, Name: name, MaxConnectedClusters: local.MaxConnectedClusters}
	if err := remote.Validate(); err != nil {
		return fmt.Errorf("%w (max-connected-clusters is %d)", err, maxConnected(local))
	}
	if name == local.Name {
		return fmt.Errorf("%q is this cluster's own name", name)
	}
	if c.ClusterID == local.ID {
		return fmt.Errorf("cluster-id %d is this cluster's own ID", c.ClusterID)
	}
	return nil
}

func maxConnected(c identity.ClusterInfo) uint32 {
	if c.MaxConnectedClusters == 0 {
		return identity.MaxConnectedClusters255
	}
	return c.MaxConnectedClusters
}

// configFile is one file of the directory as last read.
type configFile struct {
	name string
	// fingerprint is the file's content and that of the files it names,
	// so that a renewed certificate reconnects too.
	fingerprint string
	cfg         RemoteClusterConfig
	err         error
}

// isConfigName reports whether a directory entry may configure a cluster.
// Hidden entries (Kubernetes keeps a mounted secret's versions in "..data"
// and the like) and names with a dot (certificates and keys kept beside the
// configurations; cluster names hold no dot) are not configurations.
func isConfigName(name string) bool {
	return !strings.HasPrefix(name, ".") && !strings.Contains(name, ".")
}

// readConfigDir reads every configuration of the directory, by cluster
// name. Files with errors are returned with err set; a missing directory is
// an error of its own.
func readConfigDir(dir string, local identity.ClusterInfo) (map[string]*configFile, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("reading --clustermesh-config: %w", err)
	}
	out := map[string]*configFile{}
	byID := map[uint32]string{}
	for _, e := range entries {
		name := e.Name()
		if !isConfigName(name) {
			continue
		}
		path := filepath.Join(dir, name)
		info, err := os.Stat(path) // follows symlinks
		if err != nil || info.IsDir() {
			continue
		}
		data, err := os.ReadFile(path)
		f := &configFile{name: name, fingerprint: string(data)}
		out[name] = f
		if err != nil {
			f.err = fmt.Errorf("reading %s: %w", path, err)
			continue
		}
		if f.cfg, f.err = ParseRemoteClusterConfig(data, dir); f.err != nil {
			f.err = fmt.Errorf("%s: %w", path, f.err)
			continue
		}
		if f.err = validateRemote(name, f.cfg, local); f.err != nil {
			f.err = fmt.Errorf("%s: %w", path, f.err)
			continue
		}
		for _, p := range []string{f.cfg.CAFile, f.cfg.CertFile, f.cfg.KeyFile, f.cfg.PasswordFile} {
			if p != "" {
				b, _ := os.ReadFile(p)
				f.fingerprint += "\x00" + string(b)
			}
		}
	}
	// Two files claiming one ID: the name that sorts first keeps it, so
	// that the outcome does not depend on the order of the listing.
	names := make([]string, 0, len(out))
	for n := range out {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		f := out[n]
		if f.err != nil {
			continue
		}
		if other, dup := byID[f.cfg.ClusterID]; dup {
			f.err = fmt.Errorf("%s: cluster-id %d is already used by %s", filepath.Join(dir, n), f.cfg.ClusterID, other)
			continue
		}
		byID[f.cfg.ClusterID] = n
	}
	return out, nil
}
