package crdstore

import (
	"errors"
	"log/slog"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"k8s.io/client-go/rest"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/k8sclient"
	"github.com/identityd/identityd/identity"
)

// Cell offers the allocator the store that keeps global identities as
// CiliumIdentity objects in a Kubernetes API server, as the
// globalstore.Driver of crd mode and as the globalstore.Mirror the
// double-write modes compose (cells/allocator/doublewrite), and provides
// the *Store itself. It talks to the API server of the *k8sclient.Client
// (or of a *rest.Config provided on its own); with
// --identity-allocation-mode=kvstore, or without either, the *Store is nil, the driver's backend is nil and
// nothing starts. It takes the cluster's ID range as an
// identity.ClusterInfo, this node's name as an identity.NodeName and the
// stores' shared flags as a globalstore.Config (the first listing's
// timeout and the garbage collection's settings), and registers
// --identity-node-lease-ttl and --identity-gc-cilium-agents; beside Cilium
// agents (the default) it refuses a heartbeat timeout shorter than
// MinHeartbeatTimeoutBesideCilium. Its loops are jobs of this module: the
// watch of CiliumIdentity objects, the IdentityNode writer and its
// renewal, the removal of heartbeat marks from identities this node uses,
// and the garbage collection with the election of the one node of the
// cluster that runs it.
var Cell = cell.Module(
	"crdstore",
	"Global identities in Kubernetes CRD objects",

	cell.Config(DefaultConfig),
	cell.Provide(newStore, newDriver, newMirror),
	// The collectors read the store's counters; they take the store as
	// a Backend.
	cell.ProvidePrivate(func(s *Store) globalstore.Backend { return s }),
	cell.Provide(newStoreMetrics, newGCMetrics),
)

type params struct {
	cell.In

	// Client is the agent's Kubernetes client; RESTConfig, a config
	// provided on its own, serves hives without one.
	Client     *k8sclient.Client `optional:"true"`
	RESTConfig *rest.Config      `optional:"true"`
	// Mode is the configured allocation mode; absent, the store serves
	// whenever it has an API server.
	Mode    identity.AllocationMode `optional:"true"`
	Cluster identity.ClusterInfo
	Node    identity.NodeName `optional:"true"`
	Config  Config
	// Stores is the stores' shared configuration; without it, the
	// defaults (DefaultGCConfig).
	Stores globalstore.Config `optional:"true"`
	Log    *slog.Logger
	Jobs   job.Registry
	Health cell.Health `optional:"true"`
	// Sinks is where the store reports; a hive without an allocator
	// leaves its Sink unbound.
	Sinks     *globalstore.Sinks    `optional:"true"`
	AdoptOnly globalstore.AdoptOnly `optional:"true"`
	Lifecycle cell.Lifecycle
}

// newStore builds the store and registers its hooks and jobs. With the
// Kubernetes client, its clients of the API server are made at start: the
// client's settings exist once its start hook ran.
func newStore(p params) (*Store, error) {
	noServer := p.Client == nil && p.RESTConfig == nil
	if p.Mode.UsesCRD() && noServer {
		return nil, errors.New("--identity-allocation-mode=" + string(p.Mode) + " needs a Kubernetes client in the hive (k8sclient.Cell)")
	}
	if (p.Mode != "" && !p.Mode.UsesCRD()) || noServer {
		if p.Health != nil {
			if noServer {
				p.Health.OK("No Kubernetes client in the hive: no CRD identities")
			} else {
				p.Health.OK("Not used in " + string(p.Mode) + " mode")
			}
		}
		return nil, nil
	}
	h := health.OrDetached(p.Health)
	s, err := newUnconnected(p.Log, p.Cluster, p.Node, p.Config, p.Sinks.For(identity.AllocationModeCRD))
	if err != nil {
		return nil, err
	}
	s.adoptOnly = bool(p.AdoptOnly)
	if p.Client != nil {
		s.restSource = p.Client.RESTConfig
	} else if err := s.connect(p.RESTConfig); err != nil {
		return nil, err
	}
	if p.Stores != (globalstore.Config{}) {
		err := s.setGCConfig(GCConfig{
			Interval:         p.Stores.IdentityGCInterval,
			RateLimit:        p.Stores.IdentityGCRateLimit,
			RateInterval:     p.Stores.IdentityGCRateInterval,
			HeartbeatTimeout: p.Stores.IdentityHeartbeatTimeout,
		})
		if err != nil {
			return nil, err
		}
		s.listTimeout = p.Stores.AllocatorListTimeout
	}
	// Beside Cilium agents (--identity-gc-cilium-agents) the timeout
	// covers their periodic sync; without them, the fence's bound.
	if err := p.Config.validateHeartbeat(s.gc.cfg.HeartbeatTimeout); err != nil {
		return nil, err
	}
	s.register(p.Lifecycle, p.Jobs.NewGroup(h))
	return s, nil
}

// newDriver offers the store to the allocator as the driver of crd mode;
// without a store its backend is a nil interface, which the allocator
// reports as crd mode's missing store.
func newDriver(s *Store) globalstore.DriverOut {
	if s == nil {
		return globalstore.NewDriver(identity.AllocationModeCRD, nil)
	}
	return globalstore.NewDriver(identity.AllocationModeCRD, s)
}
