package kvstore

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"sync"
	"time"
)

// tlsCheckTimeout bounds one endpoint's handshake in checkTLS: a
// certificate that does not verify does so in one round trip.
const tlsCheckTimeout = 5 * time.Second

// checkTLS makes a TLS handshake with every TLS endpoint and returns an
// error naming the flag to set when every one of them failed in a way that
// no retry can mend: etcd's certificate is not signed by the CA given or
// does not name the endpoint's host, or etcd refused this client's
// certificate. gRPC would retry such an endpoint for
// the whole --kvstore-dial-timeout and then report a timeout. An endpoint
// that cannot be reached, or fails otherwise, is left to the probe.
func checkTLS(ctx context.Context, endpoints []string, cfg *tls.Config) error {
	if cfg == nil {
		return nil
	}
	errs := make([]error, len(endpoints))
	var wg sync.WaitGroup
	for i, ep := range endpoints {
		wg.Go(func() { errs[i] = checkEndpointTLS(ctx, ep, cfg) })
	}
	wg.Wait()
	for _, err := range errs {
		if err == nil {
			return nil
		}
	}
	return errors.Join(errs...)
}

// checkEndpointTLS returns a permanent TLS failure of ep, or nil.
func checkEndpointTLS(ctx context.Context, ep string, cfg *tls.Config) error {
	u, err := url.Parse(ep)
	if err != nil {
		return nil
	}
	network, addr := "tcp", u.Host
	switch u.Scheme {
	case "https":
	case "unixs":
		network, addr = "unix", u.Host+u.Path
	default:
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, tlsCheckTimeout)
	defer cancel()
	var d net.Dialer
	raw, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return nil // unreachable: the probe waits for it
	}
	defer raw.Close()
	c := cfg.Clone()
	if c.ServerName == "" && network == "tcp" {
		c.ServerName = u.Hostname()
	}
	c.NextProtos = []string{"h2"}
	conn := tls.Client(raw, c)
	if err := conn.HandshakeContext(ctx); err != nil {
		return classifyTLS(ep, err)
	}
	// With TLS 1.3 the server judges the client's certificate after the
	// client's handshake is done: its refusal is the first thing read.
	// A server that accepts it sends its HTTP/2 settings instead.
	// Go's HTTP/2 server, which etcd's is, writes its settings at once;
	// any other silence is not waited out for long.
	conn.SetReadDeadline(time.Now().Add(2 * time.Second))
	var b [1]byte
	if _, err := conn.Read(b[:]); err != nil {
		return classifyTLS(ep, err)
	}
	return nil
}

// classifyTLS returns an error naming the flag to set for a permanent TLS
// failure of ep, or nil for any other error.
func classifyTLS(ep string, err error) error {
	var (
		unknownCA *x509.UnknownAuthorityError
		invalid   x509.CertificateInvalidError
		hostname  x509.HostnameError
		verify    *tls.CertificateVerificationError
	)
	switch {
	case errors.As(err, &hostname):
		return fmt.Errorf("kvstore: etcd at %s presents a certificate for another name (%w); use an endpoint address its certificate names, or give etcd a certificate that names %s",
			ep, flatError{err}, hostname.Host)
	case errors.As(err, &unknownCA), errors.As(err, &invalid), errors.As(err, &verify):
		return fmt.Errorf("kvstore: etcd at %s presents a certificate this agent does not trust (%w); set --kvstore-ca-file to the CA that signed etcd's server certificate",
			ep, flatError{err})
	case strings.Contains(err.Error(), "remote error: tls:") && strings.Contains(err.Error(), "certificate"):
		// The server's alert: Go has no exported type for one received.
		return fmt.Errorf("kvstore: etcd at %s refused this agent's TLS handshake (%w); set --kvstore-cert-file and --kvstore-key-file to a client certificate signed by a CA that etcd trusts (its --trusted-ca-file)",
			ep, flatError{err})
	}
	return nil
}
