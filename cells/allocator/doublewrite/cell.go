package doublewrite

import (
	"errors"
	"log/slog"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/identity"
)

// Cell offers the allocator, in the double-write modes
// (--identity-allocation-mode=doublewrite-readkvstore and
// doublewrite-readcrd), the globalstore.Driver that composes the two
// stores' globalstore.Mirror values (etcdstore.Cell's and crdstore.Cell's,
// which both need in the hive), and provides the *Backend itself (nil in
// the other modes), its metrics and the doublewrite/diff shell command.
var Cell = cell.Module(
	"doublewrite",
	"Global identities written to both stores",

	cell.Config(DefaultConfig),
	cell.Provide(newBackend, newDriver, newMetrics, newCommands),
)

type params struct {
	cell.In

	// Mode is the configured --identity-allocation-mode (the allocator
	// cell provides it).
	Mode    identity.AllocationMode `optional:"true"`
	Cluster identity.ClusterInfo
	Stores  globalstore.Config
	Config  Config
	Mirrors []globalstore.MirrorDriver `group:"globalstore-mirrors"`
	Log     *slog.Logger
	Jobs    job.Registry
	Health  cell.Health `optional:"true"`
	Sinks   *globalstore.Sinks
	Lc      cell.Lifecycle
}

func newBackend(p params) (*Backend, error) {
	if !p.Mode.DoubleWrite() {
		if p.Health != nil {
			p.Health.OK("Not used in " + string(cmpMode(p.Mode)) + " mode")
		}
		return nil, nil
	}
	if err := errors.Join(p.Config.Validate(), p.Stores.Validate()); err != nil {
		return nil, err
	}
	stores := map[identity.AllocationMode]globalstore.Mirror{}
	for _, m := range p.Mirrors {
		if m.Mirror != nil {
			stores[m.Store] = m.Mirror
		}
	}
	h := health.OrDetached(p.Health)
	b, err := newDoubleWrite(p.Log, p.Mode, p.Cluster, p.Config, stores, p.Jobs.NewGroup(h))
	if err != nil {
		return nil, err
	}
	b.gcElection = p.Stores.IdentityGCInterval > 0
	b.health = h.NewScope("write-only-store")
	b.register(p.Lc, p.Sinks)
	return b, nil
}

func cmpMode(m identity.AllocationMode) identity.AllocationMode {
	if m == "" {
		return identity.AllocationModeKVStore
	}
	return m
}

// newDriver offers the Backend to the allocator as the driver of the
// configured double-write mode.
func newDriver(b *Backend) globalstore.DriverOut {
	if b == nil {
		return globalstore.NewDriver(identity.AllocationModeDoubleWriteReadKVStore, nil)
	}
	return globalstore.NewDriver(b.mode, b)
}
