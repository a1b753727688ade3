package kvstore

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

	"go.etcd.io/etcd/client/pkg/v3/transport"
)

// embeddedTLSDir is the directory inside the state directory that holds
// the certificates of the embedded etcd; its files are replaced at every
// start.
const embeddedTLSDir = "etcd-tls"

// Files in embeddedTLSDir, all mode 0600 in a 0700 directory. The CA's key
// is never written: nothing can sign another certificate the server would
// accept, and the certificates of an earlier start stop working.
const (
	embeddedCAFile         = "ca.crt"
	embeddedServerCertFile = "server.crt"
	embeddedServerKeyFile  = "server.key"
	embeddedClientCertFile = "client.crt"
	embeddedClientKeyFile  = "client.key"
)

// embeddedCertLifetime is long enough never to run out under one running
// agent; a start makes new certificates anyway.
const embeddedCertLifetime = 20 * 365 * 24 * time.Hour

// embeddedCerts are the files written for one start of the embedded etcd
// and the agent's client side of them.
type embeddedCerts struct {
	dir       string
	clientTLS *tls.Config
}

// serverTLSInfo is the server side of both listeners: the server
// certificate, and a client certificate from this start's CA required of
// every connection.
func (c *embeddedCerts) serverTLSInfo() transport.TLSInfo {
	return transport.TLSInfo{
		CertFile:       filepath.Join(c.dir, embeddedServerCertFile),
		KeyFile:        filepath.Join(c.dir, embeddedServerKeyFile),
		TrustedCAFile:  filepath.Join(c.dir, embeddedCAFile),
		ClientCertAuth: true,
	}
}

// writeEmbeddedCerts makes a fresh CA, a server certificate for 127.0.0.1
// and a client certificate, and writes them to dir (created 0700, an
// existing one tightened to 0700).
func writeEmbeddedCerts(dir string, now time.Time) (*embeddedCerts, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("creating embedded etcd certificate directory: %w", err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return nil, fmt.Errorf("setting mode 0700 on %s: %w", dir, err)
	}
	// Temporary files of a start that died while writing.
	if stale, err := filepath.Glob(filepath.Join(dir, ".*.tmp*")); err == nil {
		for _, f := range stale {
			os.Remove(f)
		}
	}
	ca, caKey, err := newCert(now, nil, nil, &x509.Certificate{
		Subject:               pkix.Name{CommonName: "identityd embedded etcd CA"},
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	})
	if err != nil {
		return nil, err
	}
	server, serverKey, err := newCert(now, ca, caKey, &x509.Certificate{
		Subject:     pkix.Name{CommonName: "identityd embedded etcd"},
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		DNSNames:    []string{"localhost"},
	})
	if err != nil {
		return nil, err
	}
	client, clientKey, err := newCert(now, ca, caKey, &x509.Certificate{
		Subject:     pkix.Name{CommonName: "identityd"},
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	})
	if err != nil {
		return nil, err
	}
	serverKeyPEM, err := keyPEM(serverKey)
	if err != nil {
		return nil, err
	}
	clientKeyPEM, err := keyPEM(clientKey)
	if err != nil {
		return nil, err
	}
	clientCertPEM := certPEM(client)
	for _, f := range []struct {
		name string
		data []byte
	}{
		{embeddedCAFile, certPEM(ca)},
		{embeddedServerCertFile, certPEM(server)},
		{embeddedServerKeyFile, serverKeyPEM},
		{embeddedClientCertFile, clientCertPEM},
		{embeddedClientKeyFile, clientKeyPEM},
	} {
		if err := writePrivateFile(filepath.Join(dir, f.name), f.data); err != nil {
			return nil, err
		}
	}

	pool := x509.NewCertPool()
	pool.AddCert(ca)
	clientPair, err := tls.X509KeyPair(clientCertPEM, clientKeyPEM)
	if err != nil {
		return nil, fmt.Errorf("embedded etcd client certificate: %w", err)
	}
	return &embeddedCerts{
		dir: dir,
		clientTLS: &tls.Config{
			MinVersion:   tls.VersionTLS12,
			RootCAs:      pool,
			Certificates: []tls.Certificate{clientPair},
		},
	}, nil
}

// newCert makes a P-256 key and a certificate for it from template, signed
// by parent (self-signed when parent is nil).
func newCert(now time.Time, parent *x509.Certificate, parentKey *ecdsa.PrivateKey, template *x509.Certificate) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("generating a key for %s: %w", template.Subject.CommonName, err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, nil, fmt.Errorf("generating a serial number: %w", err)
	}
	template.SerialNumber = serial
	// An hour back: a clock stepped back a little must not make the
	// certificates not yet valid.
	template.NotBefore = now.Add(-time.Hour)
	template.NotAfter = now.Add(embeddedCertLifetime)
	if parent == nil {
		parent, parentKey = template, key
	}
	der, err := x509.CreateCertificate(rand.Reader, template, parent, &key.PublicKey, parentKey)
	if err != nil {
		return nil, nil, fmt.Errorf("creating certificate %s: %w", template.Subject.CommonName, err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, fmt.Errorf("parsing certificate %s: %w", template.Subject.CommonName, err)
	}
	return cert, key, nil
}

func certPEM(c *x509.Certificate) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})
}

func keyPEM(key *ecdsa.PrivateKey) ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("encoding a key: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), nil
}

// writePrivateFile replaces path with data, mode 0600, through a temporary
// file and a rename: a reader never sees half a file, and a file that had
// a wider mode is replaced rather than rewritten in place.
func writePrivateFile(path string, data []byte) error {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp")
	if err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	tmp := f.Name()
	_, err = f.Write(data)
	if err == nil {
		err = f.Chmod(0o600)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return nil
}
