package etcdtest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// Certs are the files of a test PKI: a CA, a server certificate for
// 127.0.0.1/localhost and a client certificate, all signed by the CA.
type Certs struct {
	CAFile         string
	CAKeyFile      string // for IssueClientCert
	ServerCertFile string
	ServerKeyFile  string
	ClientCertFile string
	ClientKeyFile  string
}

// GenerateCerts writes a fresh CA, server and client certificate with their
// keys into dir (PEM, keys mode 0600). The client certificate's common name
// is "root", so that with auth enabled a client authenticated by it acts as
// the root user.
func GenerateCerts(dir string) (*Certs, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("etcdtest: creating cert dir: %w", err)
	}
	now := time.Now()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("etcdtest: generating CA key: %w", err)
	}
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "identityd test CA"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, fmt.Errorf("etcdtest: creating CA certificate: %w", err)
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return nil, fmt.Errorf("etcdtest: parsing CA certificate: %w", err)
	}

	caKeyDER, err := x509.MarshalECPrivateKey(caKey)
	if err != nil {
		return nil, fmt.Errorf("etcdtest: encoding CA key: %w", err)
	}

	c := &Certs{
		CAFile:         filepath.Join(dir, "ca.pem"),
		CAKeyFile:      filepath.Join(dir, "ca-key.pem"),
		ServerCertFile: filepath.Join(dir, "server.pem"),
		ServerKeyFile:  filepath.Join(dir, "server-key.pem"),
		ClientCertFile: filepath.Join(dir, "client.pem"),
		ClientKeyFile:  filepath.Join(dir, "client-key.pem"),
	}
	if err := writePEM(c.CAFile, "CERTIFICATE", caDER, 0o644); err != nil {
		return nil, err
	}
	if err := writePEM(c.CAKeyFile, "EC PRIVATE KEY", caKeyDER, 0o600); err != nil {
		return nil, err
	}
	if err := issue(ca, caKey, 2, pkix.Name{CommonName: "localhost"}, x509.ExtKeyUsageServerAuth, c.ServerCertFile, c.ServerKeyFile); err != nil {
		return nil, err
	}
	if err := issue(ca, caKey, 3, pkix.Name{CommonName: "root"}, x509.ExtKeyUsageClientAuth, c.ClientCertFile, c.ClientKeyFile); err != nil {
		return nil, err
	}
	return c, nil
}

// IssueClientCert writes a further client certificate signed by the CA,
// with the given common name and organizations (the user name and groups a
// Kubernetes API server reads from it), as certFile and keyFile (key mode
// 0600).
func (c *Certs) IssueClientCert(cn string, organizations []string, certFile, keyFile string) error {
	caCert, err := tls.LoadX509KeyPair(c.CAFile, c.CAKeyFile)
	if err != nil {
		return fmt.Errorf("etcdtest: loading CA: %w", err)
	}
	ca, err := x509.ParseCertificate(caCert.Certificate[0])
	if err != nil {
		return fmt.Errorf("etcdtest: parsing CA certificate: %w", err)
	}
	caKey, ok := caCert.PrivateKey.(*ecdsa.PrivateKey)
	if !ok {
		return fmt.Errorf("etcdtest: CA key in %s is not ECDSA", c.CAKeyFile)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return fmt.Errorf("etcdtest: serial number: %w", err)
	}
	subject := pkix.Name{CommonName: cn, Organization: organizations}
	return issue(ca, caKey, serial.Int64()+4, subject, x509.ExtKeyUsageClientAuth, certFile, keyFile)
}

// issue writes a certificate for subject signed by the CA, valid for the
// loopback addresses, and its key.
func issue(ca *x509.Certificate, caKey *ecdsa.PrivateKey, serial int64, subject pkix.Name, usage x509.ExtKeyUsage, certFile, keyFile string) error {
	cn := subject.CommonName
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("etcdtest: generating key for %s: %w", cn, err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial),
		Subject:      subject,
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{usage},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
		DNSNames:     []string{"localhost"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return fmt.Errorf("etcdtest: creating certificate for %s: %w", cn, err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return fmt.Errorf("etcdtest: encoding key for %s: %w", cn, err)
	}
	if err := writePEM(certFile, "CERTIFICATE", der, 0o644); err != nil {
		return err
	}
	return writePEM(keyFile, "EC PRIVATE KEY", keyDER, 0o600)
}

// ClientTLS returns a client TLS configuration that trusts the CA and
// presents the client certificate.
func (c *Certs) ClientTLS() (*tls.Config, error) {
	caPEM, err := os.ReadFile(c.CAFile)
	if err != nil {
		return nil, fmt.Errorf("etcdtest: reading CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return nil, fmt.Errorf("etcdtest: no certificate in %s", c.CAFile)
	}
	cert, err := tls.LoadX509KeyPair(c.ClientCertFile, c.ClientKeyFile)
	if err != nil {
		return nil, fmt.Errorf("etcdtest: loading client certificate: %w", err)
	}
	return &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}, nil
}

func writePEM(path, typ string, der []byte, mode os.FileMode) error {
	data := pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der})
	if err := os.WriteFile(path, data, mode); err != nil {
		return fmt.Errorf("etcdtest: writing %s: %w", path, err)
	}
	return nil
}
