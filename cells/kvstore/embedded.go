package kvstore

import (
	"context"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"sync/atomic"

	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap/zapcore"
)

// embeddedName is the member name of the embedded etcd. It is fixed so
// that the data directory stays valid when --node-name changes.
const embeddedName = "identityd"

// embeddedEtcd is a single-member etcd running inside the agent, listening
// on loopback ports the kernel picks so that nothing is fixed or shared.
type embeddedEtcd struct {
	etcd      *embed.Etcd
	clientURL string
	stopping  *atomic.Bool
}

// benignWarnings are warnings of the embedded server that do not apply to
// a single member serving only this process on loopback.
var benignWarnings = map[string]bool{
	"Running http and grpc server on single port. This is not recommended for production.": true,
	"simple token is not cryptographically signed":                                         true,
}

func startEmbedded(ctx context.Context, log *slog.Logger, dataDir string) (*embeddedEtcd, error) {
	if err := os.MkdirAll(dataDir, 0o700); err != nil {
		return nil, fmt.Errorf("creating embedded etcd data directory: %w", err)
	}
	// Port 0: the listeners get ephemeral ports; the actual client address
	// is read back from the listener below.
	ephemeral := url.URL{Scheme: "http", Host: "127.0.0.1:0"}
	cfg := embed.NewConfig()
	cfg.Name = embeddedName
	cfg.Dir = dataDir
	cfg.ListenClientUrls = []url.URL{ephemeral}
	cfg.AdvertiseClientUrls = []url.URL{ephemeral}
	cfg.ListenPeerUrls = []url.URL{ephemeral}
	cfg.AdvertisePeerUrls = []url.URL{ephemeral}
	cfg.InitialCluster = cfg.InitialClusterFromName(embeddedName)
	cfg.LogLevel = "warn"
	// While stopping, the server reports its closed listeners as errors:
	// expected then, so they are kept out of the agent's warnings.
	stopping := new(atomic.Bool)
	demote := func(msg string) bool { return stopping.Load() || benignWarnings[msg] }
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(newZapLogger(log.With("component", "embedded-etcd"), zapcore.WarnLevel, demote))
	// Keep the history from growing without bound: identities churn.
	cfg.AutoCompactionMode = embed.CompactorModePeriodic
	cfg.AutoCompactionRetention = "1h"

	e, err := embed.StartEtcd(cfg)
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
	return &embeddedEtcd{
		etcd:      e,
		clientURL: "http://" + e.Clients[0].Addr().String(),
		stopping:  stopping,
	}, nil
}

func (e *embeddedEtcd) stop() {
	e.stopping.Store(true)
	e.etcd.Close()
}
