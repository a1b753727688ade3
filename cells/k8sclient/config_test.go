package k8sclient_test

import (
	"math"
	"strings"
	"testing"
	"time"

	"github.com/identityd/identityd/cells/k8sclient"
)

func TestConfigValidate(t *testing.T) {
	ok := k8sclient.DefaultConfig
	if err := ok.Validate(); err != nil {
		t.Fatalf("default config: %v", err)
	}
	for _, tt := range []struct {
		name   string
		change func(*k8sclient.Config)
		want   string
	}{
		{"negative qps", func(c *k8sclient.Config) { c.K8sClientQPS = -1 }, "--k8s-client-qps -1 must not be negative"},
		{"NaN qps", func(c *k8sclient.Config) { c.K8sClientQPS = math.NaN() }, "--k8s-client-qps NaN is not a number"},
		{"huge qps", func(c *k8sclient.Config) { c.K8sClientQPS = 1e300 }, "--k8s-client-qps 1e+300 is too large"},
		{"negative burst", func(c *k8sclient.Config) { c.K8sClientQPS, c.K8sClientBurst = 5, -1 }, "--k8s-client-burst -1 must not be negative"},
		{"burst without qps", func(c *k8sclient.Config) { c.K8sClientBurst = 10 }, "--k8s-client-burst 10 needs --k8s-client-qps"},
		{"zero timeout", func(c *k8sclient.Config) { c.K8sRequestTimeout = 0 }, "--k8s-request-timeout 0s must be positive"},
		{"server not a URL", func(c *k8sclient.Config) { c.K8sAPIServer = "127.0.0.1:6443" }, `--k8s-api-server "127.0.0.1:6443" is not a URL`},
		{"server scheme", func(c *k8sclient.Config) { c.K8sAPIServer = "ftp://h:1" }, `--k8s-api-server "ftp://h:1" is not a URL`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := k8sclient.DefaultConfig
			tt.change(&c)
			err := c.Validate()
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Validate() = %v, want an error containing %q", err, tt.want)
			}
		})
	}
	c := k8sclient.DefaultConfig
	c.K8sClientQPS, c.K8sClientBurst, c.K8sRequestTimeout = 50, 100, time.Second
	c.K8sAPIServer = "https://127.0.0.1:6443"
	if err := c.Validate(); err != nil {
		t.Fatalf("valid config: %v", err)
	}
}
