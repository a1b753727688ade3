package k8sclient

import (
	"errors"
	"fmt"
	"math"
	"net/url"
	"time"

	"github.com/spf13/pflag"
)

// Config is the Kubernetes client cell's configuration. The flag names are
// Cilium's.
type Config struct {
	// K8sKubeconfigPath is the kubeconfig file to use (its current
	// context). Empty: --k8s-api-server alone, or the in-cluster config.
	K8sKubeconfigPath string
	// K8sAPIServer is the API server's URL. With a kubeconfig it replaces
	// the kubeconfig's server; alone, an https URL uses the in-cluster
	// credentials when they exist, as Cilium does.
	K8sAPIServer string
	// K8sClientQPS caps the requests per second of this node's client;
	// 0 is no client-side limit (the API server's own flow control
	// still applies).
	K8sClientQPS float64
	// K8sClientBurst is how many requests may exceed K8sClientQPS at
	// once; 0 is ceil(QPS). Needs K8sClientQPS.
	K8sClientBurst int
	// K8sRequestTimeout bounds every request but watches (whose server
	// ends them itself), and the reachability check at start.
	K8sRequestTimeout time.Duration
}

// DefaultConfig is the default configuration: no client-side rate limit,
// 30s per request.
var DefaultConfig = Config{
	K8sRequestTimeout: 30 * time.Second,
}

// Flags registers the --k8s-* flags of the client.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.String("k8s-kubeconfig-path", def.K8sKubeconfigPath, "Kubeconfig file of the Kubernetes API server (its current context); empty: --k8s-api-server, else the in-cluster config")
	flags.String("k8s-api-server", def.K8sAPIServer, "URL of the Kubernetes API server; replaces the kubeconfig's server")
	flags.Float64("k8s-client-qps", def.K8sClientQPS, "Maximum Kubernetes API requests per second from this node; 0 means no client-side limit")
	flags.Int("k8s-client-burst", def.K8sClientBurst, "Requests that may exceed --k8s-client-qps at once; 0 means ceil(--k8s-client-qps)")
	flags.Duration("k8s-request-timeout", def.K8sRequestTimeout, "Timeout of a single Kubernetes API request (watches excepted), and of the reachability check at start")
}

// Configured reports whether a flag names an API server to talk to, which
// asks for the client whatever the allocation mode.
func (c Config) Configured() bool { return c.K8sKubeconfigPath != "" || c.K8sAPIServer != "" }

// Validate checks the configuration without touching files or network.
func (c Config) Validate() error {
	var errs []error
	switch {
	case math.IsNaN(c.K8sClientQPS) || math.IsInf(c.K8sClientQPS, 0):
		errs = append(errs, fmt.Errorf("--k8s-client-qps %g is not a number of requests per second", c.K8sClientQPS))
	case c.K8sClientQPS < 0:
		errs = append(errs, fmt.Errorf("--k8s-client-qps %g must not be negative (0 means no limit)", c.K8sClientQPS))
	case c.K8sClientQPS > math.MaxFloat32:
		errs = append(errs, fmt.Errorf("--k8s-client-qps %g is too large (0 means no limit)", c.K8sClientQPS))
	}
	switch {
	case c.K8sClientBurst < 0:
		errs = append(errs, fmt.Errorf("--k8s-client-burst %d must not be negative", c.K8sClientBurst))
	case c.K8sClientBurst > 0 && c.K8sClientQPS == 0:
		// A burst without a rate limits nothing: say so rather than
		// ignore it.
		errs = append(errs, fmt.Errorf("--k8s-client-burst %d needs --k8s-client-qps (0 means no limit, so no burst applies)", c.K8sClientBurst))
	}
	if c.K8sRequestTimeout <= 0 {
		errs = append(errs, fmt.Errorf("--k8s-request-timeout %s must be positive", c.K8sRequestTimeout))
	}
	if c.K8sAPIServer != "" {
		u, err := url.Parse(c.K8sAPIServer)
		if err != nil || u.Host == "" || (u.Scheme != "https" && u.Scheme != "http") {
			errs = append(errs, fmt.Errorf("--k8s-api-server %q is not a URL like https://host:port", c.K8sAPIServer))
		}
	}
	return errors.Join(errs...)
}

// burst is the token bucket's size for a positive QPS.
func (c Config) burst() int {
	if c.K8sClientBurst > 0 {
		return c.K8sClientBurst
	}
	return max(1, int(math.Ceil(c.K8sClientQPS)))
}
