package kvstore_test

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// Environment of the test binary re-executed as another user: the agent's
// client endpoints, its etcd's peer URLs and its state directory.
const (
	foreignEndpointsEnv = "KVSTORE_FOREIGN_ENDPOINTS"
	foreignPeersEnv     = "KVSTORE_FOREIGN_PEERS"
	foreignStateDirEnv  = "KVSTORE_FOREIGN_STATE_DIR"
)

// foreignUID is the unprivileged local user the access test runs as.
const foreignUID = "65534"

// TestEmbeddedEtcdRefusesOtherUsers runs a client as another local user
// against the agent's embedded etcd: it must not read keys, write a key or
// add a member, whatever it tries (plain HTTP, TLS without a certificate,
// the certificate files of the state directory), and must not reach the
// peer listener either.
func TestEmbeddedEtcdRefusesOtherUsers(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: runs a client as uid " + foreignUID + " with setpriv")
	}
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		t.Skip("needs setpriv (util-linux) to run a client as uid " + foreignUID)
	}
	t.Parallel()
	// Everything lives in a directory every user may enter (t.TempDir's
	// are 0700), so that only the modes the agent sets keep the other
	// user out, as under /var/run.
	base, err := os.MkdirTemp("", "kvstore-foreign-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	if err := os.Chmod(base, 0o755); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(base, "state")
	n := newNode(t, dir, nil)
	if err := n.start(); err != nil {
		t.Fatal(err)
	}
	checkPrivate(t, dir)
	cli := n.client.Client()
	if _, err := cli.Put(ctxT(t), "cilium/state/identities/v1/id/256", "k8s:app=held;"); err != nil {
		t.Fatal(err)
	}
	members, err := cli.MemberList(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	var peers []string
	for _, m := range members.Members {
		peers = append(peers, m.PeerURLs...)
	}

	// The test binary lives in the go tool's private build directory: copy
	// it where the other user can run it.
	bin := filepath.Join(base, "kvstore.test")
	copyExecutable(t, bin)

	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, setpriv, "--reuid="+foreignUID, "--regid="+foreignUID, "--clear-groups", bin)
	cmd.Dir = base
	cmd.Env = append(os.Environ(),
		foreignEndpointsEnv+"="+strings.Join(n.client.Endpoints(), ","),
		foreignPeersEnv+"="+strings.Join(peers, ","),
		foreignStateDirEnv+"="+dir,
	)
	out, err := cmd.CombinedOutput()
	t.Logf("uid %s against %v (peers %v):\n%s", foreignUID, n.client.Endpoints(), peers, out)
	if err != nil {
		t.Errorf("a client of uid %s got access to the embedded etcd (or could not run): %v", foreignUID, err)
	}
	// A run that tried nothing proves nothing.
	for _, via := range []string{"plain", "tls without certificate"} {
		for _, op := range []string{"read keys", "write a key", "add a member"} {
			if want := fmt.Sprintf("refused: %s: %s: ", via, op); !strings.Contains(string(out), want) {
				t.Errorf("no refused attempt %q in the output", want)
			}
		}
	}

	// Nothing it tried left a trace, and the agent still works.
	if resp, err := cli.Get(ctxT(t), "foreign"); err != nil {
		t.Errorf("the agent cannot read after the attempts: %v", err)
	} else if len(resp.Kvs) > 0 {
		t.Errorf("uid %s wrote a key: %q", foreignUID, resp.Kvs[0].Value)
	}
	members, err = cli.MemberList(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	if len(members.Members) != 1 {
		t.Errorf("uid %s changed the membership: %v", foreignUID, members.Members)
	}
	if _, err := cli.Put(ctxT(t), "after", "ok"); err != nil {
		t.Errorf("the agent cannot write after the attempts: %v", err)
	}
}

// checkPrivate checks that the state directory and every directory in it
// is 0700 and every file 0600, or a socket (reachable only through its
// 0700 directory).
func checkPrivate(t *testing.T, dir string) {
	t.Helper()
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		switch mode := fi.Mode(); {
		case mode.IsDir() && mode.Perm() != 0o700:
			t.Errorf("directory %s has mode %v, want 0700", path, mode.Perm())
		case mode.IsRegular() && mode.Perm() != 0o600:
			t.Errorf("file %s has mode %v, want 0600", path, mode.Perm())
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func copyExecutable(t *testing.T, dst string) {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	src, err := os.Open(self)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	f, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(f, src); err != nil {
		f.Close()
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}

// foreignClient is what the test binary does when re-executed as another
// user: every way a local user could try to reach the agent's etcd. It
// prints one line per attempt and returns 0 when every attempt was
// refused, 1 when one got through.
func foreignClient() int {
	endpoints := strings.Split(os.Getenv(foreignEndpointsEnv), ",")
	var peers []string
	if p := os.Getenv(foreignPeersEnv); p != "" {
		peers = strings.Split(p, ",")
	}
	stateDir := os.Getenv(foreignStateDirEnv)

	type attempt struct {
		name string
		run  func(context.Context) error
	}
	// Reads, writes and the peer first; membership last, since an added
	// member that never starts costs the cluster its quorum and every
	// later request would time out.
	var attempts, reconfigure []attempt
	for _, v := range foreignTransports(endpoints, stateDir) {
		if v.err != nil {
			fmt.Printf("refused: %s: %v\n", v.name, v.err)
			continue
		}
		for _, op := range []struct {
			name   string
			config bool
			run    func(context.Context, *clientv3.Client) error
		}{
			{"read keys", false, func(ctx context.Context, c *clientv3.Client) error {
				_, err := c.Get(ctx, "", clientv3.WithPrefix(), clientv3.WithKeysOnly())
				return err
			}},
			{"write a key", false, func(ctx context.Context, c *clientv3.Client) error {
				_, err := c.Put(ctx, "foreign", "written by another user")
				return err
			}},
			{"add a member", true, func(ctx context.Context, c *clientv3.Client) error {
				_, err := c.MemberAdd(ctx, []string{"http://127.0.0.1:9"})
				return err
			}},
		} {
			a := attempt{v.name + ": " + op.name, func(ctx context.Context) error {
				c, err := clientv3.New(clientv3.Config{
					Endpoints:   v.endpoints,
					TLS:         v.tls,
					DialTimeout: 3 * time.Second,
					Logger:      zap.NewNop(),
				})
				if err != nil {
					return err
				}
				defer c.Close()
				return op.run(ctx, c)
			}}
			if op.config {
				reconfigure = append(reconfigure, a)
			} else {
				attempts = append(attempts, a)
			}
		}
	}
	// The peer listener takes membership and raft messages: it must not
	// answer either.
	for _, p := range peers {
		for _, scheme := range []string{"http", "https"} {
			u, err := url.Parse(p)
			if err != nil {
				fmt.Printf("refused: peer %q is not a URL: %v\n", p, err)
				continue
			}
			u.Scheme = scheme
			u.Path = "/members"
			attempts = append(attempts, attempt{"peer " + u.String(), func(ctx context.Context) error {
				hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
				req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
				if err != nil {
					return err
				}
				resp, err := hc.Do(req)
				if err != nil {
					return err
				}
				defer resp.Body.Close()
				body, _ := io.ReadAll(io.LimitReader(resp.Body, 200))
				if resp.StatusCode != http.StatusOK {
					return fmt.Errorf("status %s", resp.Status)
				}
				fmt.Printf("peer answered: %s\n", body)
				return nil
			}})
		}
	}

	var (
		mu      sync.Mutex
		granted int
	)
	for _, phase := range [][]attempt{attempts, reconfigure} {
		var wg sync.WaitGroup
		for _, a := range phase {
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				err := a.run(ctx)
				mu.Lock()
				defer mu.Unlock()
				if err == nil {
					granted++
					fmt.Printf("GRANTED: %s\n", a.name)
					return
				}
				fmt.Printf("refused: %s: %s\n", a.name, strings.Join(strings.Fields(err.Error()), " "))
			})
		}
		wg.Wait()
	}
	if granted > 0 {
		return 1
	}
	return 0
}

type foreignTransport struct {
	name      string
	endpoints []string
	tls       *tls.Config
	err       error // why this transport could not even be set up
}

// foreignTransports are the ways to speak to endpoints: plain HTTP, TLS
// without a client certificate, and TLS with any certificate and key the
// state directory would give away.
func foreignTransports(endpoints []string, stateDir string) []foreignTransport {
	withScheme := func(scheme string) []string {
		out := make([]string, len(endpoints))
		for i, ep := range endpoints {
			u, err := url.Parse(ep)
			if err != nil {
				out[i] = ep
				continue
			}
			u.Scheme = scheme
			out[i] = u.String()
		}
		return out
	}
	out := []foreignTransport{
		{name: "plain", endpoints: withScheme("http")},
		{name: "tls without certificate", endpoints: withScheme("https"), tls: &tls.Config{InsecureSkipVerify: true}},
	}
	// Any PEM pair under the state directory, found by walking it: the
	// walk itself must be refused.
	var certs, keys []string
	walkErr := filepath.WalkDir(stateDir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		switch {
		case strings.HasSuffix(path, ".key"), strings.HasSuffix(path, "-key.pem"):
			keys = append(keys, path)
		case strings.HasSuffix(path, ".crt"), strings.HasSuffix(path, ".pem"):
			certs = append(certs, path)
		}
		return nil
	})
	if walkErr != nil {
		out = append(out, foreignTransport{name: "state directory certificates", err: walkErr})
	}
	// The walk needs to list directories; a file may still be opened by
	// name through a directory that only lets one pass.
	certs = append(certs, filepath.Join(stateDir, "etcd-tls", "client.crt"), filepath.Join(stateDir, "etcd-tls", "server.crt"))
	keys = append(keys, filepath.Join(stateDir, "etcd-tls", "client.key"), filepath.Join(stateDir, "etcd-tls", "server.key"))
	for _, c := range certs {
		for _, k := range keys {
			pair, err := tls.LoadX509KeyPair(c, k)
			if err != nil {
				if errors.Is(err, fs.ErrPermission) {
					out = append(out, foreignTransport{name: "certificate " + c + " with key " + k, err: err})
				}
				continue // not there, or not a matching pair
			}
			out = append(out, foreignTransport{
				name:      "certificate " + c + " with key " + k,
				endpoints: withScheme("https"),
				tls:       &tls.Config{InsecureSkipVerify: true, Certificates: []tls.Certificate{pair}},
			})
		}
	}
	return out
}

// dialable reports whether something accepts TCP connections at the host
// of u.
func dialable(u string) error {
	parsed, err := url.Parse(u)
	if err != nil {
		return err
	}
	c, err := net.DialTimeout("tcp", parsed.Host, 5*time.Second)
	if err != nil {
		return err
	}
	return c.Close()
}

// TestEmbeddedAdvertisesRealURLs checks that the member record of the
// embedded etcd names the addresses it listens on, also after a restart
// that got other ports, so that etcdctl and status show usable URLs.
func TestEmbeddedAdvertisesRealURLs(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for round := range 2 {
		n := newNode(t, dir, nil)
		if err := n.start(); err != nil {
			t.Fatal(err)
		}
		eps := n.client.Endpoints()
		members, err := n.client.Client().MemberList(ctxT(t))
		if err != nil {
			t.Fatal(err)
		}
		if len(members.Members) != 1 {
			t.Fatalf("round %d: members %v, want one", round, members.Members)
		}
		m := members.Members[0]
		if len(m.ClientURLs) != 1 || m.ClientURLs[0] != eps[0] {
			t.Errorf("round %d: advertised client URLs %v, want the endpoint in use %v", round, m.ClientURLs, eps)
		}
		if len(m.PeerURLs) != 1 {
			t.Fatalf("round %d: advertised peer URLs %v, want one", round, m.PeerURLs)
		}
		for _, u := range append(m.ClientURLs, m.PeerURLs...) {
			if strings.HasSuffix(u, ":0") {
				t.Errorf("round %d: advertised URL %s has port 0", round, u)
			}
			if err := dialable(u); err != nil {
				t.Errorf("round %d: nothing listens at advertised URL %s: %v", round, u, err)
			}
		}
		st := n.client.Status(ctxT(t))
		if st.Connected() != 1 || st.Leader != eps[0] {
			t.Errorf("round %d: status %+v", round, st)
		}
		n.stop()
	}
}

// TestEmbeddedTakesOverPlainDataDir starts the agent on the data of an
// embedded etcd that served plain HTTP and advertised port 0, as earlier
// versions did: the member record gets the real TLS URLs.
func TestEmbeddedTakesOverPlainDataDir(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ephemeral := url.URL{Scheme: "http", Host: "127.0.0.1:0"}
	cfg := embed.NewConfig()
	cfg.Name = "identityd"
	cfg.Dir = filepath.Join(dir, "etcd")
	cfg.ListenClientUrls = []url.URL{ephemeral}
	cfg.AdvertiseClientUrls = []url.URL{ephemeral}
	cfg.ListenPeerUrls = []url.URL{ephemeral}
	cfg.AdvertisePeerUrls = []url.URL{ephemeral}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
	old, err := embed.StartEtcd(cfg)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-old.Server.ReadyNotify():
	case <-time.After(time.Minute):
		t.Fatal("plain etcd not ready")
	}
	oldCli, err := clientv3.New(clientv3.Config{Endpoints: []string{"http://" + old.Clients[0].Addr().String()}, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := oldCli.Put(ctxT(t), "kept", "yes"); err != nil {
		t.Fatal(err)
	}
	oldCli.Close()
	old.Close()

	n := newNode(t, dir, nil)
	if err := n.start(); err != nil {
		t.Fatal(err)
	}
	cli := n.client.Client()
	if v, ok := mustGet(t, cli, "kept"); !ok || v != "yes" {
		t.Fatalf("key of the plain etcd: %q, %v", v, ok)
	}
	members, err := cli.MemberList(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	if len(members.Members) != 1 {
		t.Fatalf("members %v", members.Members)
	}
	m := members.Members[0]
	for _, u := range append(m.ClientURLs, m.PeerURLs...) {
		if !strings.HasPrefix(u, "https://127.0.0.1:") || strings.HasSuffix(u, ":0") {
			t.Errorf("advertised URL %s, want https on a real loopback port", u)
		}
	}
}

// TestEmbeddedCertificatesArePrivate checks the certificate directory: a
// loose mode left by anyone is tightened, the files are 0600, and every
// start makes new certificates, so that a copy taken earlier is useless.
func TestEmbeddedCertificatesArePrivate(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	tlsDir := filepath.Join(dir, "etcd-tls")
	if err := os.MkdirAll(tlsDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(tlsDir, "client.key"), []byte("left by someone\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(tlsDir, 0o755); err != nil {
		t.Fatal(err)
	}

	n := newNode(t, dir, nil)
	if err := n.start(); err != nil {
		t.Fatal(err)
	}
	checkPrivate(t, dir)
	copyTLS := func() *tls.Config {
		t.Helper()
		pair, err := tls.LoadX509KeyPair(filepath.Join(tlsDir, "client.crt"), filepath.Join(tlsDir, "client.key"))
		if err != nil {
			t.Fatal(err)
		}
		return &tls.Config{InsecureSkipVerify: true, Certificates: []tls.Certificate{pair}}
	}
	get := func(tlsCfg *tls.Config, endpoints []string) error {
		c, err := clientv3.New(clientv3.Config{Endpoints: endpoints, TLS: tlsCfg, DialTimeout: 2 * time.Second, Logger: zap.NewNop()})
		if err != nil {
			return err
		}
		defer c.Close()
		ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
		defer cancel()
		_, err = c.Get(ctx, "k")
		return err
	}
	// The files as written are what the agent's user (and so an operator
	// with etcdctl) reaches the server with.
	old := copyTLS()
	if err := get(old, n.client.Endpoints()); err != nil {
		t.Fatalf("with the state directory's client certificate: %v", err)
	}
	n.stop()

	n2 := newNode(t, dir, nil)
	if err := n2.start(); err != nil {
		t.Fatal(err)
	}
	checkPrivate(t, dir)
	if err := get(old, n2.client.Endpoints()); err == nil {
		t.Error("the client certificate of the previous start still works")
	}
	if err := get(copyTLS(), n2.client.Endpoints()); err != nil {
		t.Errorf("with the new client certificate: %v", err)
	}
}
