package kvstore

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	"go.etcd.io/etcd/server/v3/etcdserver/api/membership"
	"go.uber.org/zap/zapcore"
	"golang.org/x/sys/unix"
)

// embeddedName is the member name of the embedded etcd. It is fixed so
// that the data directory stays valid when --node-name changes.
const embeddedName = "identityd"

// portAttempts bounds how often the start picks new ports when another
// process took a picked port before etcd bound it.
const portAttempts = 5

// embeddedEtcd is a single-member etcd running inside the agent. Both its
// listeners are TLS on loopback and require a client certificate that only
// the agent's user can read (see embeddedCerts): any local user can open a
// TCP connection, none but the agent's user can complete a handshake.
type embeddedEtcd struct {
	etcd      *embed.Etcd
	clientURL string
	peerURL   string
	clientTLS *tls.Config
	stopping  *atomic.Bool
}

// benignWarnings are warnings of the embedded server that do not apply to
// a single member serving only this process on loopback.
var benignWarnings = map[string]bool{
	"Running http and grpc server on single port. This is not recommended for production.": true,
	"simple token is not cryptographically signed":                                         true,
}

// startEmbedded starts the embedded etcd with its data in dataDir and its
// certificates in tlsDir.
func startEmbedded(ctx context.Context, log *slog.Logger, dataDir, tlsDir string) (*embeddedEtcd, error) {
	if err := os.MkdirAll(dataDir, 0o700); err != nil {
		return nil, fmt.Errorf("creating embedded etcd data directory: %w", err)
	}
	if err := checkFreeSpace(dataDir); err != nil {
		return nil, err
	}
	certs, err := writeEmbeddedCerts(tlsDir, time.Now())
	if err != nil {
		return nil, err
	}
	// While stopping, the server reports its closed listeners as errors:
	// expected then, so they are kept out of the agent's warnings.
	stopping := new(atomic.Bool)
	demote := func(msg string) bool { return stopping.Load() || benignWarnings[msg] }
	zapLog := newZapLogger(log.With("component", "embedded-etcd"), zapcore.WarnLevel, demote)

	var lastErr error
	for range portAttempts {
		// The advertised URLs are stored in the member record and shown
		// by etcdctl and kvstore/status: they must name the real ports,
		// so the ports are picked before etcd starts rather than left to
		// the kernel (port 0) at bind time.
		ports, err := freeLoopbackPorts(2)
		if err != nil {
			return nil, fmt.Errorf("picking ports for the embedded etcd: %w", err)
		}
		clientURL := url.URL{Scheme: "https", Host: net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[0]))}
		peerURL := url.URL{Scheme: "https", Host: net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[1]))}

		cfg := embed.NewConfig()
		cfg.Name = embeddedName
		cfg.Dir = dataDir
		cfg.ListenClientUrls = []url.URL{clientURL}
		cfg.AdvertiseClientUrls = []url.URL{clientURL}
		cfg.ListenPeerUrls = []url.URL{peerURL}
		cfg.AdvertisePeerUrls = []url.URL{peerURL}
		cfg.InitialCluster = cfg.InitialClusterFromName(embeddedName)
		cfg.ClientTLSInfo = certs.serverTLSInfo()
		cfg.PeerTLSInfo = certs.serverTLSInfo()
		// Nothing uses etcd's JSON gateway: one protocol less to expose.
		cfg.EnableGRPCGateway = false
		cfg.LogLevel = "warn"
		cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zapLog)
		// Keep the history from growing without bound: identities churn.
		cfg.AutoCompactionMode = embed.CompactorModePeriodic
		cfg.AutoCompactionRetention = "1h"

		e, err := embed.StartEtcd(cfg)
		if errors.Is(err, syscall.EADDRINUSE) {
			// Another process took a port between picking and binding.
			lastErr = err
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("starting embedded etcd in %s: %w", dataDir, err)
		}
		select {
		case <-e.Server.ReadyNotify():
		case err := <-e.Err():
			e.Close()
			return nil, fmt.Errorf("embedded etcd in %s failed: %w", dataDir, err)
		case <-ctx.Done():
			e.Close()
			return nil, fmt.Errorf("embedded etcd in %s not ready in time: %w", dataDir, ctx.Err())
		}
		ee := &embeddedEtcd{
			etcd:      e,
			clientURL: clientURL.String(),
			peerURL:   peerURL.String(),
			clientTLS: certs.clientTLS,
			stopping:  stopping,
		}
		if err := ee.updatePeerURL(ctx); err != nil {
			ee.stop()
			return nil, fmt.Errorf("embedded etcd in %s: %w", dataDir, err)
		}
		return ee, nil
	}
	return nil, fmt.Errorf("starting embedded etcd in %s: no free loopback ports after %d attempts: %w", dataDir, portAttempts, lastErr)
}

// updatePeerURL rewrites the member's peer URL when it differs from the
// one listened on now. etcd publishes the client URLs at every start but
// keeps the peer URL of the first start (or of an agent that advertised
// port 0); the ports change with every start.
func (e *embeddedEtcd) updatePeerURL(ctx context.Context) error {
	srv := e.etcd.Server
	m := srv.Cluster().Member(srv.MemberID())
	if m == nil {
		return fmt.Errorf("member %s is missing from its own cluster", srv.MemberID())
	}
	want := []string{e.peerURL}
	if slices.Equal(m.PeerURLs, want) {
		return nil
	}
	update := membership.Member{ID: m.ID, RaftAttributes: membership.RaftAttributes{PeerURLs: want}}
	err := proposeConfChange(ctx, confChangeAttempt, func(ctx context.Context) error {
		_, err := srv.UpdateMember(ctx, update)
		return err
	})
	if err != nil {
		return fmt.Errorf("updating the member's peer URL from %v to %s: %w", m.PeerURLs, e.peerURL, err)
	}
	return nil
}

// confChangeAttempt bounds one proposal of a membership change. Raft drops
// a configuration change proposed before a new leader has applied the
// entries of its log (it appends an empty entry instead), and etcd then
// waits for an apply that never comes: after a restart that followed a
// crash, the start hung there until its deadline. The same change proposed
// again once the log is applied goes through.
const confChangeAttempt = 3 * time.Second

// proposeConfChange calls propose with a deadline of attempt each time,
// until it succeeds, fails otherwise than by that deadline, or ctx ends.
// The changes it is used for are idempotent, so an attempt that timed out
// but was applied after all does no harm when proposed again.
func proposeConfChange(ctx context.Context, attempt time.Duration, propose func(context.Context) error) error {
	for {
		actx, cancel := context.WithTimeout(ctx, attempt)
		err := propose(actx)
		timedOut := actx.Err() != nil
		cancel()
		if err == nil || !timedOut || ctx.Err() != nil {
			return err
		}
	}
}

// freeLoopbackPorts returns n distinct loopback ports that were free a
// moment ago. All are held open together, so they differ.
func freeLoopbackPorts(n int) ([]int, error) {
	ports := make([]int, 0, n)
	var lns []net.Listener
	defer func() {
		for _, l := range lns {
			l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		lns = append(lns, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

func (e *embeddedEtcd) stop() {
	e.stopping.Store(true)
	e.etcd.Close()
}

// The free space the embedded etcd needs at start: a new data directory
// gets a write-ahead log whose first 64 MiB segment etcd allocates at once,
// so it needs that and room for its database, its certificates, the
// checkpoint and the map file; an existing one needs that room only (etcd
// starts, with a warning, when it cannot allocate its next segment ahead).
const (
	EmbeddedMinFreeBytesNew      = 160 << 20
	EmbeddedMinFreeBytesExisting = 16 << 20
)

// ErrNoSpace: the state directory's file system has too little free space
// for the embedded etcd to start.
var ErrNoSpace = errors.New("too little free space for the embedded etcd")

// checkFreeSpace refuses to start the embedded etcd in dataDir where it
// could not write, with an error that says how much space is missing,
// rather than a failure halfway through the start. A file system whose
// free space cannot be read passes.
func checkFreeSpace(dataDir string) error {
	var st unix.Statfs_t
	if err := unix.Statfs(dataDir, &st); err != nil {
		return nil
	}
	need, what := uint64(EmbeddedMinFreeBytesNew), "a new etcd data directory: its first 64 MiB write-ahead log segment and the next one, allocated ahead"
	if _, err := os.Stat(filepath.Join(dataDir, "member", "wal")); err == nil {
		need, what = EmbeddedMinFreeBytesExisting, "the etcd database, its log and the agent's state files"
	}
	free := st.Bavail * uint64(st.Bsize)
	if free >= need {
		return nil
	}
	return fmt.Errorf("%w: %s has %d MiB free, the embedded etcd needs %d MiB (%s); free %d MiB there, or give --state-dir a larger file system or --kvstore-endpoints an external etcd",
		ErrNoSpace, dataDir, free>>20, need>>20, what, (need-free+(1<<20)-1)>>20)
}
