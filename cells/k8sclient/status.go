package k8sclient

import (
	"context"
	"time"
)

// statusTimeout bounds Status's request, so that a hung API server makes
// k8s/status slow, not stuck.
const statusTimeout = 5 * time.Second

// Status describes the client's connection to the API server.
type Status struct {
	// Server is the API server's URL.
	Server string
	// Source says where the settings came from: the kubeconfig path,
	// --k8s-api-server, or the in-cluster service account.
	Source string
	// QPS and Burst are the client-side rate limit; QPS 0 is none.
	QPS   float64
	Burst int
	// RequestTimeout is --k8s-request-timeout.
	RequestTimeout time.Duration
	// Connected is true when the API server answered /version now.
	Connected bool
	// Version is the server's gitVersion, as /version says.
	Version string
	// Error is why /version failed; empty when it answered.
	Error string
	// LastError is the last request failure since the start, empty when
	// none.
	LastError string
}

// Status asks the API server for its version. It does not fail: an
// unreachable server is reported in the result.
func (c *Client) Status(ctx context.Context) Status {
	st := Status{QPS: c.cfg.K8sClientQPS, RequestTimeout: c.cfg.K8sRequestTimeout}
	if st.QPS > 0 {
		st.Burst = c.cfg.burst()
	}
	c.mu.Lock()
	st.Source = c.source
	if c.base != nil {
		st.Server = c.base.Host
	}
	c.mu.Unlock()
	version := c.endpoint("version")
	if version == "" {
		st.Error = ErrNotStarted.Error()
		st.LastError = c.LastError()
		return st
	}
	ctx, cancel := context.WithTimeout(ctx, statusTimeout)
	defer cancel()
	body, err := c.get(ctx, version)
	if err != nil {
		st.Error = err.Error()
		st.LastError = c.LastError()
		return st
	}
	st.Connected, st.Version = true, gitVersion(body)
	st.LastError = c.LastError()
	return st
}
