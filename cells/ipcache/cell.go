package ipcache

import (
	"log/slog"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"golang.org/x/time/rate"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/internal/ipcachemap"
)

// Cell provides *IPCache, the read-only ipcache table
// (statedb.Table[*Entry]) and the ipcache/* shell commands. It needs
// allocator.Allocator, *statedir.Dir, statedb, jobs and health, and uses
// allocator.LocalIdentitySyncer (the checkpoint cell's) when the hive has
// it, so that IPCache.WaitDurable covers local identities too.
var Cell = cell.Module(
	"ipcache",
	"Prefix to identity cache and its datapath map",

	cell.Config(DefaultConfig),
	cell.ProvidePrivate(
		NewTable,
		func(r job.Registry, h cell.Health) job.Group { return r.NewGroup(h) },
	),
	cell.Provide(
		statedb.RWTable[*Entry].ToTable,
		newIPCache,
		newCommands,
		newIPCacheMetrics,
	),
)

type params struct {
	cell.In

	Config     Config
	Log        *slog.Logger
	DB         *statedb.DB
	Table      statedb.RWTable[*Entry]
	Allocator  allocator.Allocator
	Dir        *statedir.Dir
	Lifecycle  cell.Lifecycle
	Jobs       job.Group
	Reconciler reconciler.Params
	// LocalSync is the checkpoint's, when the hive has one: WaitDurable
	// waits for it for prefixes with local identities.
	LocalSync allocator.LocalIdentitySyncer `optional:"true"`
}

func newIPCache(p params) (*IPCache, error) {
	if err := p.Config.Validate(); err != nil {
		return nil, err
	}
	c := &IPCache{
		log:       p.Log,
		db:        p.DB,
		table:     p.Table,
		alloc:     p.Allocator,
		localSync: p.LocalSync,
		mapConfig: ipcachemap.Config{
			Kind:       ipcachemap.Kind(p.Config.IPCacheMap),
			PinPath:    p.Config.IPCacheMapPinPath,
			MaxEntries: p.Config.IPCacheMapMaxEntries,
			FilePath:   p.Dir.Join(ipcachemap.FileName),
			// A waited answer appends to the journal; the file is the
			// snapshot the sync job writes once per compactInterval.
			Journal: true,
		},
		dualStack: p.Config.IPCacheDualStack,
		ready:     make(chan struct{}),
		syncNow:   make(chan struct{}, 1),
	}
	// The table stays uninitialized, and the map unpruned, until
	// restoration has finished; other initializers (restoration's own,
	// until its prefixes are back) extend that.
	wtxn := p.DB.WriteTxn(p.Table)
	c.selfDone = p.Table.RegisterInitializer(wtxn, selfInitializer)
	wtxn.Commit()

	// The hook is appended before the reconciler's jobs, so the map is
	// open before they start (and they stop before it is closed, as job
	// hooks stop first).
	p.Lifecycle.Append(c)

	rec, err := reconciler.Register(
		p.Reconciler,
		p.Table,
		(*Entry).clone,
		(*Entry).setStatus,
		(*Entry).getStatus,
		ops{c},
		ops{c},
		reconciler.WithPruning(pruneInterval),
		reconciler.WithRefreshing(0, nil),
		reconciler.WithRoundLimits(roundSize, rate.NewLimiter(roundsPerSecond, 1)),
	)
	if err != nil {
		return nil, err
	}
	c.rec = rec
	p.Jobs.Add(job.OneShot("ipcache-map-sync", c.syncLoop))
	// Appended before the drain hook, it still runs while drain waits.
	p.Jobs.Add(job.OneShot("ipcache-wait-for-restoration", c.waitForRestoration))
	// Appended after the reconciler's jobs, this hook stops before them:
	// rows upserted but not yet written reach the map before it closes.
	p.Lifecycle.Append(cell.Hook{OnStop: c.drain})
	return c, nil
}
