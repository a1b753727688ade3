package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/identityd/identityd/internal/retry"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"golang.org/x/time/rate"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/idpool"
	"github.com/identityd/identityd/internal/logtext"
	"github.com/identityd/identityd/labels"
)

// The etcd key layout of global identities, shared with Cilium agents.
const (
	// IdentitiesPrefix is the base prefix of global identities in etcd.
	IdentitiesPrefix = "cilium/state/identities/v1"
	// MasterKeyPrefix precedes a numeric ID; the key's value is the
	// canonical label string and carries no lease.
	MasterKeyPrefix = IdentitiesPrefix + "/id/"
	// ReferenceKeyPrefix precedes "<canonical labels>/<node>"; the value is
	// the numeric ID and the key lives on the node's lease.
	ReferenceKeyPrefix = IdentitiesPrefix + "/value/"
	// LockKeyPrefix precedes "<canonical labels>/<lease hex>": the lock
	// Cilium agents take while they allocate a label set.
	LockKeyPrefix = IdentitiesPrefix + "/locks/"
)

// Bounds of one allocation. Conflicts are rare (IDs are picked at random and
// the cache knows most used ones), so a handful of them in a row means
// something is wrong; transient errors get more room because a leader
// election takes seconds.
const (
	maxConflicts   = 16
	maxTransient   = 30
	listPageSize   = 1000
	restoreWorkers = 16
	// syncBatch is how many reference keys one transaction of the
	// periodic sync checks: well within etcd's --max-txn-ops (128 by
	// default), which bounds its compares and its Else's reads.
	syncBatch = 64
)

type params struct {
	cell.In

	Client *kvstore.Client `optional:"true"`
	// Mode is the configured --identity-allocation-mode (the allocator
	// cell provides it); a hive without it runs in kvstore mode.
	Mode    identity.AllocationMode `optional:"true"`
	Cluster identity.ClusterInfo
	Stores  globalstore.Config
	Config  Config
	Log     *slog.Logger
	Jobs    job.Registry
	Health  cell.Health `optional:"true"`
	// Sinks is where the store reports; a hive without an allocator
	// leaves its Sink unbound.
	Sinks     *globalstore.Sinks `optional:"true"`
	Lifecycle cell.Lifecycle
}

// newStore provides the *Store when the hive has a kvstore client and runs
// in a mode that uses etcd (kvstore, or a double-write mode). Otherwise it provides nil and builds and starts nothing:
// the store's driver then offers no backend.
func newStore(p params) (*Store, error) {
	if !p.Mode.UsesKVStore() || p.Client == nil {
		if p.Health != nil {
			// Nothing else reports to the module then; a scope that
			// never reports reads as unknown.
			if p.Mode == identity.AllocationModeCRD {
				p.Health.OK("Not used in crd mode: global identities are CiliumIdentity objects")
			} else {
				p.Health.OK("No kvstore in the hive: no global identities")
			}
		}
		return nil, nil
	}
	if err := errors.Join(p.Stores.Validate(), p.Config.Validate()); err != nil {
		return nil, err
	}
	h := health.OrDetached(p.Health)
	b := newUnstarted(p.Log, p.Client, p.Cluster, p.Stores, p.Config, p.Sinks.For(identity.AllocationModeKVStore))
	b.health = h.NewScope("node-name")
	b.register(p.Lifecycle, p.Jobs.NewGroup(h))
	return b, nil
}

// newDriver offers the store to the allocator as the driver of kvstore
// mode; without a store its backend is a nil interface, which the
// allocator treats as "no global backend" (allocator.ErrNoGlobalBackend).
func newDriver(s *Store) globalstore.DriverOut {
	if s == nil {
		return globalstore.NewDriver(identity.AllocationModeKVStore, nil)
	}
	return globalstore.NewDriver(identity.AllocationModeKVStore, s)
}

// newMirror offers the store to the double-write modes (cells/allocator/doublewrite).
func newMirror(s *Store) globalstore.MirrorOut {
	if s == nil {
		return globalstore.NewMirror(identity.AllocationModeKVStore, nil)
	}
	return globalstore.NewMirror(identity.AllocationModeKVStore, s)
}

// Store is the globalstore.Backend that keeps global identities in etcd
// with Cilium's key layout. A new label set costs one transaction, adopting
// another node's identity at most two (one when the cache knows it), and
// the last release one delete. It keeps a cache of all master keys by
// list and watch, re-creates this node's keys after a lost lease, and
// collects unused master keys.
type Store struct {
	log     *slog.Logger
	kv      *kvstore.Client
	shared  globalstore.Config
	cfg     Config
	cluster identity.ClusterInfo
	node    string
	pool    *idpool.Pool

	// masterCache is the list+watch cache of all master keys; the
	// backend keeps its ID pool in step with it and reports its changes
	// to events.
	masterCache
	events globalstore.Events

	// refs is the allocator's record of this node's references (its
	// Sink); the store keeps none of its own, only the revision it last
	// wrote each reference at, in the reference's token.
	//
	// writeMu orders this node's reference writes against the
	// re-creation of all of them after a lost lease: each write holds
	// the read lock, and records the reference in refs within it
	// (Allocate's record); the restore holds the write lock and
	// enumerates refs, so it finds every reference written before it,
	// and a reference the allocator dropped before is not restored (its
	// release waits for the read lock, and reads the token the restore
	// stored).
	writeMu sync.RWMutex
	refs    globalstore.References
	// stopped is set by Stop under writeMu: from then on nothing is
	// held, so releases send no delete and nothing is written again.
	stopped atomic.Bool

	// lease is the last lease this backend wrote with; leaseSeen wakes
	// the repair loop when it changes.
	lease     atomic.Int64
	leaseSeen chan struct{}
	// predecessorLease is the lease of the agent of this node name whose
	// node key this one took over (gone from this host): its reference
	// keys are this node's to write over. Any other lease's key under this
	// node's name is another writer's (a Cilium agent with the same node
	// suffix) and never written over or deleted.
	predecessorLease atomic.Int64
	// lostMasters holds IDs whose master key vanished while this node
	// references them; repairWake tells the repair loop.
	lostMu      sync.Mutex
	lostMasters map[identity.NumericIdentity]struct{}
	repairWake  chan struct{}

	// creates sends concurrent allocations' create transactions
	// together.
	creates *createBatcher

	gcLimiter *rate.Limiter
	gc        gcCounters
	// collector is the election of the one node that collects.
	collector collector

	// claim is what this node's key says (see claimNodeName); the checks
	// of the node's keys count what they find in nodeStats and report a
	// conflict to health (nil outside a hive with health).
	claim        globalstore.NodeClaim
	nodeStats    nodeCounters
	conflictSeen atomic.Bool
	health       cell.Health

	// jobs runs the loops started after the first listing (see
	// waitListed).
	jobs job.Group
}

var _ globalstore.Mirror = (*Store)(nil)

// newUnstarted returns the store for the cluster's ID range, writing
// through kv and reporting to sink, with nothing registered to run.
func newUnstarted(log *slog.Logger, kv *kvstore.Client, cluster identity.ClusterInfo, shared globalstore.Config, cfg Config, sink *globalstore.Sink) *Store {
	perDeletion := shared.IdentityGCRateInterval / time.Duration(max(shared.IdentityGCRateLimit, 1))
	b := &Store{
		log:         log,
		kv:          kv,
		events:      sink,
		refs:        sink,
		shared:      shared,
		cfg:         cfg,
		cluster:     cluster,
		node:        kv.NodeName(),
		pool:        idpool.New(idpool.ID(cluster.MinID()), idpool.ID(cluster.MaxID())),
		leaseSeen:   make(chan struct{}, 1),
		lostMasters: map[identity.NumericIdentity]struct{}{},
		repairWake:  make(chan struct{}, 1),
		claim:       globalstore.NewNodeClaim(),
		// A burst of one keeps every window of the interval within the
		// limit.
		gcLimiter: rate.NewLimiter(rate.Every(perDeletion), 1),
	}
	b.creates = newCreateBatcher(b.requestContext)
	// Master keys of other clusters' ranges (a shared etcd) are cached
	// for lookups; the pool never hands them out.
	b.masterCache = newMasterCache(log, kv, "global identities", cacheHooks{
		stored:  func(id identity.NumericIdentity) { b.pool.Remove(idpool.ID(id)) },
		removed: func(id identity.NumericIdentity) { b.pool.Insert(idpool.ID(id)) },
		emit:    b.emit,
		synced:  func() { b.events.Synced() },
	})
	return b
}

func masterKey(id identity.NumericIdentity) string { return MasterKeyPrefix + id.String() }

// Cilium v1.16 builds the reference and lock keys of a label set with
// path.Join, which cleans the label string inside them ("//" becomes "/",
// "/./" and "x/../" go), so identityd does the same: a label set holding
// such sequences then has one reference prefix on every node, whichever
// wrote it. The master key's value stays the uncleaned string.

// referenceBase is the key that this label set's reference keys extend
// with "/<node>".
func referenceBase(key string) string { return path.Join(IdentitiesPrefix, "value", key) }

func referencePrefix(key string) string { return referenceBase(key) + "/" }

func lockPrefix(key string) string { return path.Join(IdentitiesPrefix, "locks", key) + "/" }

// ErrKeyLayout: the label set's keys, cleaned the way Cilium cleans them,
// would leave the key prefix of its kind (a "/../" climbing out of the
// label string), so it cannot be stored safely.
var ErrKeyLayout = errors.New("label set cannot be written as an etcd key")

// checkKeyLayout refuses a label set whose cleaned reference or lock keys
// would land outside their prefixes, where they could pass for another
// kind of key (a master key, say).
func checkKeyLayout(key string) error {
	if !strings.HasPrefix(referencePrefix(key), ReferenceKeyPrefix) || referencePrefix(key) == ReferenceKeyPrefix ||
		!strings.HasPrefix(lockPrefix(key), LockKeyPrefix) || lockPrefix(key) == LockKeyPrefix {
		return fmt.Errorf("%w: %q climbs out of %s once cleaned as Cilium cleans keys", ErrKeyLayout, key, IdentitiesPrefix)
	}
	return nil
}

// register makes the store an ordinary part of the hive: a hook that
// claims the node name (and at stop revokes the node's lease), the loops
// as jobs of g, and a hook that waits for the first listing. Hooks start
// in that order and stop in the reverse one, so the loops end before the
// lease goes.
func (b *Store) register(lc cell.Lifecycle, g job.Group) {
	b.jobs = g
	lc.Append(cell.Hook{OnStart: b.claimAtStart, OnStop: b.stop})
	// The requests the batcher sends for several callers at once run
	// until the loops stop (the hooks of g's jobs come after this one, so
	// they stop before it). A hook, not a job: a job's goroutine may run
	// only after the hive's start returned, and an allocation right after
	// the start was refused as if the store had stopped.
	batches, endBatches := context.WithCancel(context.Background())
	lc.Append(cell.Hook{
		OnStart: func(cell.HookContext) error {
			b.creates.start(batches)
			return nil
		},
		OnStop: func(cell.HookContext) error {
			endBatches()
			b.creates.stop()
			return nil
		},
	})
	g.Add(job.OneShot("global-identities-watch", func(ctx context.Context, _ cell.Health) error {
		b.cacheLoop(ctx)
		return nil
	}))
	g.Add(job.OneShot("lease-repair", func(ctx context.Context, _ cell.Health) error {
		b.repairLoop(ctx)
		return nil
	}))
	if b.shared.IdentityGCInterval > 0 {
		// One node of the cluster collects: the elected one.
		g.Add(job.OneShot(CollectorJob, func(ctx context.Context, h cell.Health) error {
			b.campaignLoop(ctx, h)
			return nil
		}))
		g.Add(globalstore.CollectionJob("identity-gc", b.shared.IdentityGCInterval, b.log, b.collection()))
	}
	if b.cfg.KVStorePeriodicSync > 0 {
		g.Add(job.Timer("kvstore-periodic-sync", b.syncTick, b.cfg.KVStorePeriodicSync))
	}
	lc.Append(cell.Hook{OnStart: b.waitListed})
}

// claimAtStart refuses to run beside a second live agent with this node
// name, which would delete this node's references when it stops. When
// etcd does not answer now, the periodic sync claims the name later.
func (b *Store) claimAtStart(ctx cell.HookContext) error {
	if b.kv.Client() == nil {
		return fmt.Errorf("%w: the kvstore client is not started", globalstore.ErrUnavailable)
	}
	cctx, ccancel := context.WithTimeout(ctx, b.kv.RequestTimeout())
	err := b.claimNodeName(cctx)
	ccancel()
	switch {
	case errors.Is(err, ErrNodeNameInUse):
		return err
	case err != nil:
		b.log.Warn("Could not claim the node name in etcd yet; the periodic sync retries", "node", b.node, "error", err)
	case b.health != nil:
		b.health.OK(fmt.Sprintf("Node name %q claimed", b.node))
	}
	return nil
}

// waitListed waits for the first listing of the master keys at most
// --allocator-list-timeout; when that is not enough the listing goes on
// and WaitForInitialGlobalIdentities callers wait for it. A listing that
// shows another cluster's identities fails the start.
func (b *Store) waitListed(ctx cell.HookContext) error {
	timer := time.NewTimer(b.shared.AllocatorListTimeout)
	defer timer.Stop()
	select {
	case <-b.synced:
		return b.checkCluster(ctx)
	case <-timer.C:
		b.log.Warn("Global identities not listed within --allocator-list-timeout; listing continues in the background",
			"timeout", b.shared.AllocatorListTimeout)
	case <-ctx.Done():
		b.log.Warn("Start ended before global identities were listed; listing continues in the background", "error", ctx.Err())
	}
	// Compare the cluster once the listing is complete; too late to
	// refuse the start, so a mismatch is an error in the log.
	b.jobs.Add(job.OneShot("cluster-check", func(ctx context.Context, _ cell.Health) error {
		select {
		case <-b.synced:
		case <-ctx.Done():
			return nil
		}
		if err := b.checkCluster(ctx); err != nil && ctx.Err() == nil {
			b.log.Error("This node's cluster does not match the etcd's; its identities may be another cluster's", "error", err)
		}
		return nil
	}))
	return nil
}

// stop runs after the loops ended (the jobs stop before this hook): it
// revokes the node's lease so that its reference keys vanish at once
// rather than after the TTL. The kvstore client stops after the store, so
// it is still usable. Its etcd work shares the stop path's deadline
// (kvstore.StopBudget), which also ends the requests of callers still in
// flight: with etcd gone the stop takes seconds, and the references
// expire with the lease's TTL.
func (b *Store) stop(ctx cell.HookContext) error {
	sctx, cancel := b.kv.StopContext(ctx)
	defer cancel()
	b.writeMu.Lock()
	defer b.writeMu.Unlock()
	// The allocator's record outlives the stop (its users release
	// later): from here on the store treats it as empty.
	b.stopped.Store(true)
	b.releaseNodeName()
	if err := b.kv.RevokeLease(sctx); err != nil {
		// Not a failure of the stop: nothing more can be done, and
		// the lease's TTL removes the references.
		b.log.Warn("Revoking the node's etcd lease failed; its identity references expire with the lease's TTL",
			"error", err, "ttl", b.kv.LeaseTTL())
	}
	return nil
}

// LookupByID implements globalstore.Backend from the cache.
func (b *Store) LookupByID(id identity.NumericIdentity) (labels.Labels, bool) {
	return b.lookupLabels(id)
}

// LookupByLabels implements globalstore.Backend from the cache.
func (b *Store) LookupByLabels(lbls labels.Labels) (identity.NumericIdentity, bool) {
	return b.cachedID(lbls.Canonical())
}

// outcome says what an allocation attempt found and what to try next.
type outcome int

const (
	outDone   outcome = iota // this node references the identity now
	outAdopt                 // the label set has an ID: reference it
	outNewID                 // the candidate ID is taken: pick another
	outLocked                // a Cilium agent holds the label set's lock
	outWait                  // references point to an ID without master key
	// outForeign: the reference prefix holds only keys of label sets
	// whose canonical strings extend this one with "/" (Cilium allows
	// "/" in sources), none of this label set's: create again, comparing
	// that nothing under the prefix changed since revision rev.
	outForeign
	// outAdoptScanned: at revision rev every reference of the label set
	// named id, and keys of other label sets share its prefix: adopt id,
	// comparing that nothing under the prefix changed since.
	outAdoptScanned
)

type attempt struct {
	out     outcome
	id      identity.NumericIdentity
	created bool
	rev     int64
}

// Allocate implements globalstore.Backend. record runs under writeMu's read
// lock, in the same critical section as the transaction that wrote the
// reference.
func (b *Store) Allocate(ctx context.Context, lbls labels.Labels, record func(*globalstore.Reference)) (identity.NumericIdentity, bool, error) {
	return b.allocate(ctx, lbls, record, true)
}

// Adopt implements globalstore.Backend: Allocate's adoption of the master
// key the cache shows for the label set, never its create.
func (b *Store) Adopt(ctx context.Context, lbls labels.Labels, record func(*globalstore.Reference)) (identity.NumericIdentity, error) {
	id, _, err := b.allocate(ctx, lbls, record, false)
	return id, err
}

// allocate is Allocate; without create, a label set whose master key the
// cache does not show (at the start, or after an attempt found the key
// gone or another label set's) fails with ErrNoIdentity.
func (b *Store) allocate(ctx context.Context, lbls labels.Labels, record func(*globalstore.Reference), create bool) (identity.NumericIdentity, bool, error) {
	key := lbls.Canonical()
	if err := checkKeyLayout(key); err != nil {
		return 0, false, fmt.Errorf("allocating global identity for %s: %w", key, err)
	}
	// A label set the cache knows is adopted directly: one transaction.
	hint, _ := b.cachedID(key)
	var conflicts, transient, waits int
	// foreignRev is set once the label set's reference prefix is known to
	// hold keys of other label sets only (see outForeign); adoptRev while
	// hint is the ID all its references named at that revision (see
	// outAdoptScanned).
	var foreignRev, adoptRev int64
	for {
		if err := ctx.Err(); err != nil {
			return 0, false, fmt.Errorf("allocating global identity for %s: %w", key, err)
		}
		var (
			a   attempt
			err error
		)
		if hint == 0 && !create {
			if hint, _ = b.cachedID(key); hint == 0 {
				return 0, false, fmt.Errorf("adopting global identity for %s: %w", key, globalstore.ErrNoIdentity)
			}
		}
		if hint != 0 {
			a, err = b.adopt(ctx, key, lbls, hint, adoptRev, record)
		} else {
			a, err = b.create(ctx, key, lbls, foreignRev, record)
		}
		if err != nil {
			if errors.Is(err, globalstore.ErrSpaceExhausted) || errors.Is(err, globalstore.ErrConflict) || errors.Is(err, ErrKeyLayout) {
				return 0, false, fmt.Errorf("allocating global identity for %s: %w", key, err)
			}
			if !retryable(err) || ctx.Err() != nil {
				return 0, false, fmt.Errorf("%w: allocating global identity for %s: %w", globalstore.ErrUnavailable, key, err)
			}
			if transient++; transient > maxTransient {
				return 0, false, fmt.Errorf("%w: allocating global identity for %s after %d attempts: %w", globalstore.ErrUnavailable, key, transient, err)
			}
			b.log.Debug("Retrying global identity allocation", "labels", key, "error", err)
			if !isLeaseNotFound(err) {
				retry.Sleep(ctx, retry.Backoff(transient))
			}
			continue
		}
		switch a.out {
		case outDone:
			return a.id, a.created, nil
		case outAdopt:
			hint, adoptRev = a.id, 0
			continue
		case outAdoptScanned:
			hint, adoptRev = a.id, a.rev
			continue
		case outLocked:
			// Cilium's lock is held for one allocation; it is not a
			// conflict with us, so only the context bounds the wait.
			waits++
			retry.Sleep(ctx, retry.Backoff(min(waits, 6)))
			continue
		case outWait:
			hint, adoptRev = 0, 0
			retry.Sleep(ctx, retry.Backoff(conflicts+1))
		case outNewID:
			hint, adoptRev = 0, 0
		case outForeign:
			hint, adoptRev, foreignRev = 0, 0, a.rev
		}
		if conflicts++; conflicts > maxConflicts {
			return 0, false, fmt.Errorf("%w: %s after %d attempts", globalstore.ErrConflict, key, conflicts)
		}
	}
}

// create tries to create the label set with a random free ID in one
// transaction that is safe against every other writer: the ID has no master
// key, no node references the label set, no Cilium agent holds its lock. On
// failure the same round trip reads why, so the next step needs no read.
//
// foreignRev is 0, or a revision at which the label set's reference prefix
// held keys of other label sets only; then "no node references the label
// set" is compared as "no key under the prefix was written after
// foreignRev", since those keys would fail a compare that none exists.
func (b *Store) create(ctx context.Context, key string, lbls labels.Labels, foreignRev int64, record func(*globalstore.Reference)) (attempt, error) {
	nid := b.pool.LeaseAvailableID()
	if nid == idpool.NoID {
		return attempt{}, globalstore.ErrSpaceExhausted
	}
	id := identity.NumericIdentity(nid)
	res, wrote, err := b.writing(ctx, func(cli *clientv3.Client, lease clientv3.LeaseID) (attempt, error) {
		return b.createWith(ctx, cli, lease, key, lbls, foreignRev, nid, id, record)
	})
	if !wrote {
		b.pool.Release(nid)
	}
	return res, err
}

// createWith is create's transaction, under writeMu's read lock.
func (b *Store) createWith(ctx context.Context, cli *clientv3.Client, lease clientv3.LeaseID, key string, lbls labels.Labels, foreignRev int64, nid idpool.ID, id identity.NumericIdentity, record func(*globalstore.Reference)) (attempt, error) {
	master, refs, locks := masterKey(id), referencePrefix(key), lockPrefix(key)
	ref := refs + b.node
	resp, settled, err := b.creates.commit(ctx, &createItem{
		cli:    cli,
		req:    createTxn(master, refs, locks, b.node, key, id.String(), lease, foreignRev),
		master: master,
		ref:    ref,
		settle: func(resp *pb.TxnResponse, err error) { b.settleAbandoned(nid, ref, resp, err) },
	})
	if err != nil {
		if !settled {
			b.pool.Release(nid)
		}
		return attempt{}, err
	}
	if resp.Succeeded {
		rev := resp.Header.GetRevision()
		b.pool.Use(nid)
		record(globalstore.NewReference(id, lbls, rev))
		b.insertCreated(id, key, lbls, rev)
		return attempt{out: outDone, id: id, created: true}, nil
	}

	masterKVs, refKVs := b.settleFailedCreate(nid, resp)
	if len(refKVs) > 0 {
		ref := refKVs[0]
		if !isReferenceOf(ref.Key, refs) {
			// Only a label set whose canonical string extends ours
			// with "/" could own this key; look for ours (adopt
			// checks that they agree).
			ids, rev, err := b.scanReferences(ctx, cli, refs)
			if err != nil {
				return attempt{}, err
			}
			for refID := range ids {
				return attempt{out: outAdopt, id: refID}, nil
			}
			return attempt{out: outForeign, rev: rev}, nil
		}
		refID, err := identity.ParseNumericIdentity(string(ref.Value))
		if err != nil || refID == identity.InvalidIdentity {
			return attempt{}, fmt.Errorf("reference key %s holds %q, not a numeric identity", ref.Key, ref.Value)
		}
		return attempt{out: outAdopt, id: refID}, nil
	}
	if len(masterKVs) > 0 && string(masterKVs[0].Value) == key {
		// A master key of this label set that nobody references (its
		// holders left and GC has not run): take it over.
		return attempt{out: outAdopt, id: id}, nil
	}
	if len(masterKVs) == 0 && len(refKVs) == 0 {
		// Neither the ID nor the label set is taken: the lock
		// compare failed.
		return attempt{out: outLocked}, nil
	}
	return attempt{out: outNewID}, nil
}

// settleFailedCreate returns the reads of a create transaction whose
// compares failed, and gives its candidate ID back to the pool unless the
// ID turned out to be taken.
func (b *Store) settleFailedCreate(nid idpool.ID, resp *pb.TxnResponse) (masterKVs, refKVs []*mvccpb.KeyValue) {
	masterKVs = resp.Responses[0].GetResponseRange().GetKvs()
	refKVs = resp.Responses[1].GetResponseRange().GetKvs()
	if len(masterKVs) > 0 {
		b.pool.Remove(nid)
	} else {
		b.pool.Release(nid)
	}
	return masterKVs, refKVs
}

// settleAbandoned takes over a create transaction whose caller gave up
// while it was in flight in a shared request (see createBatcher). Created
// keys are undone as far as they are this node's: the reference is
// deleted if it is still this write (another allocation of the label set
// may have written it anew meanwhile), the master key is left to the
// garbage collection like any unused one, and the cache learns of it from
// the watch. Without an answer the outcome is unknown, as when a single
// request is given up on: the watch corrects the pool, and a reference
// that was written expires with the lease.
func (b *Store) settleAbandoned(nid idpool.ID, ref string, resp *pb.TxnResponse, err error) {
	switch {
	case err != nil:
		b.pool.Release(nid)
	case !resp.Succeeded:
		b.settleFailedCreate(nid, resp)
	default:
		b.pool.Use(nid)
		cli := b.kv.Client()
		if cli == nil {
			return
		}
		rctx, cancel := b.requestContext(b.creates.ctx)
		defer cancel()
		if _, err := releaseTxn(cli.Txn(rctx), ref, resp.Header.GetRevision()).Commit(); err != nil {
			b.log.Debug("Deleting the reference of an abandoned allocation failed; it expires with the lease", "key", ref, "error", err)
		}
	}
}

// createTxn builds create's transaction: master is the candidate ID's
// master key, refs and locks the label set's reference and lock prefixes,
// value the label set's canonical string and id the ID's decimal form.
//
// The failure branch reads the master key and the first reference, not the
// locks: the reads run at the revision of the compares, so when neither
// key exists the lock compare is the one that failed. A third read would
// cost every transaction a few percent of the server's time (the branch is
// written to the raft log even when it does not run) to save nothing.
//
// The request is built as protobuf messages rather than with clientv3's
// Txn builder, which clones each compare two or three times through
// protobuf reflection: about 10 µs of client CPU per transaction, a tenth
// of what the client spends on it, taken from the server when both share
// a small machine. The benchmarks issue the same request without an
// allocator, to measure what its shape costs the server.
//
// foreignRev, when not 0, replaces the compare that no reference key exists
// with one that no key under refs was written after foreignRev (see
// create).
func createTxn(master, refs, locks, node, value, id string, lease clientv3.LeaseID, foreignRev int64) *pb.TxnRequest {
	masterKey, refsKey := []byte(master), []byte(refs)
	refsCompare := notCreated(refsKey, prefixEnd(refs))
	if foreignRev != 0 {
		refsCompare = notWrittenSince(refsKey, prefixEnd(refs), foreignRev)
	}
	return &pb.TxnRequest{
		Compare: []*pb.Compare{
			notCreated(masterKey, nil),
			refsCompare,
			notCreated([]byte(locks), prefixEnd(locks)),
		},
		Success: []*pb.RequestOp{
			{Request: &pb.RequestOp_RequestPut{RequestPut: &pb.PutRequest{Key: masterKey, Value: []byte(value)}}},
			{Request: &pb.RequestOp_RequestPut{RequestPut: &pb.PutRequest{
				Key: []byte(refs + node), Value: []byte(id), Lease: int64(lease)}}},
		},
		Failure: []*pb.RequestOp{
			{Request: &pb.RequestOp_RequestRange{RequestRange: &pb.RangeRequest{Key: masterKey}}},
			{Request: &pb.RequestOp_RequestRange{RequestRange: &pb.RangeRequest{
				Key: refsKey, RangeEnd: prefixEnd(refs), Limit: 1}}},
		},
	}
}

// notCreated compares that no key in [key, rangeEnd) exists (only key
// when rangeEnd is nil), as clientv3.CreateRevision(key) = 0 does.
func notCreated(key, rangeEnd []byte) *pb.Compare {
	return &pb.Compare{
		Key:         key,
		RangeEnd:    rangeEnd,
		Target:      pb.Compare_CREATE,
		Result:      pb.Compare_EQUAL,
		TargetUnion: &pb.Compare_CreateRevision{CreateRevision: 0},
	}
}

// notWrittenSince compares that no key in [key, rangeEnd) was written
// after revision rev; an empty range passes.
func notWrittenSince(key, rangeEnd []byte, rev int64) *pb.Compare {
	return &pb.Compare{
		Key:         key,
		RangeEnd:    rangeEnd,
		Target:      pb.Compare_MOD,
		Result:      pb.Compare_LESS,
		TargetUnion: &pb.Compare_ModRevision{ModRevision: rev + 1},
	}
}

// prefixEnd is the end of the range of keys starting with prefix.
func prefixEnd(prefix string) []byte { return []byte(clientv3.GetPrefixRangeEnd(prefix)) }

// commitTxn issues a transaction built as a protobuf request the way
// clientv3's Txn(...).Commit() does: through the client's interceptors
// (the kvstore's metrics and rate limit, clientv3's retries), waiting for
// a connection rather than failing fast, with errors translated alike.
func commitTxn(ctx context.Context, cli *clientv3.Client, req *pb.TxnRequest) (*pb.TxnResponse, error) {
	resp, err := clientv3.RetryKVClient(cli).Txn(ctx, req, grpc.WaitForReady(true))
	if err != nil {
		return nil, clientv3.ContextError(ctx, err)
	}
	return resp, nil
}

// isReferenceOf reports whether key is a reference key directly under
// prefix: node names hold no "/", label strings may.
func isReferenceOf(key []byte, prefix string) bool {
	rest, ok := strings.CutPrefix(string(key), prefix)
	return ok && rest != "" && !strings.Contains(rest, "/")
}

// adopt writes this node's reference to id, provided id's master key still
// holds the label set and no node references the label set under another
// ID. A label set can have two master keys (a create that reached etcd
// after the last reference to the first one was released), so a master key
// that holds the label set does not make its ID the label set's: without
// the second compare, nodes whose caches picked different master keys
// would use two IDs for it at once.
//
// scannedAt is 0, or a revision at which every reference of the label set
// named id and the prefix also held keys of other label sets (see
// outForeign), which fail the compare that every key under the prefix
// names id; the compare is then that nothing under it changed since.
func (b *Store) adopt(ctx context.Context, key string, lbls labels.Labels, id identity.NumericIdentity, scannedAt int64, record func(*globalstore.Reference)) (attempt, error) {
	res, _, err := b.writing(ctx, func(cli *clientv3.Client, lease clientv3.LeaseID) (attempt, error) {
		return b.adoptWith(ctx, cli, lease, key, lbls, id, scannedAt, record)
	})
	return res, err
}

// adoptWith is adopt's transaction, under writeMu's read lock.
func (b *Store) adoptWith(ctx context.Context, cli *clientv3.Client, lease clientv3.LeaseID, key string, lbls labels.Labels, id identity.NumericIdentity, scannedAt int64, record func(*globalstore.Reference)) (attempt, error) {
	master, refs := masterKey(id), referencePrefix(key)
	end := clientv3.GetPrefixRangeEnd(refs)
	holds := clientv3.Compare(clientv3.Value(master), "=", key)
	agree := clientv3.Compare(clientv3.Value(refs), "=", id.String()).WithRange(end)
	if scannedAt != 0 {
		agree = clientv3.Compare(clientv3.ModRevision(refs), "<", scannedAt+1).WithRange(end)
	}
	own := refs + b.node
	put := clientv3.OpPut(own, id.String(), clientv3.WithLease(lease))
	// This node's reference key is missing (lease 0), or on the lease
	// this node found it on: never one another writer put there.
	var ownLease int64
	var resp *clientv3.TxnResponse
	var nested *pb.TxnResponse
	for attempts := 0; ; attempts++ {
		mine := clientv3.Compare(clientv3.LeaseValue(own), "=", ownLease)
		rctx, cancel := b.requestContext(ctx)
		// A value compare over an empty range fails, so a label set
		// nobody references is the nested transaction's case.
		var err error
		resp, err = cli.Txn(rctx).
			If(holds, agree, mine).
			Then(put).
			Else(clientv3.OpTxn(
				[]clientv3.Cmp{holds, clientv3.Compare(clientv3.CreateRevision(refs), "=", 0).WithRange(end)},
				[]clientv3.Op{put},
				[]clientv3.Op{clientv3.OpGet(master), clientv3.OpGet(refs, clientv3.WithRange(end), clientv3.WithLimit(1)), clientv3.OpGet(own)},
			)).
			Commit()
		cancel()
		if err != nil {
			return attempt{}, err
		}
		nested = resp.Responses[0].GetResponseTxn()
		if resp.Succeeded || nested.GetSucceeded() {
			b.pool.Remove(idpool.ID(id))
			record(globalstore.NewReference(id, lbls, resp.Header.GetRevision()))
			return attempt{out: outDone, id: id}, nil
		}
		kvs := nested.Responses[2].GetResponseRange().GetKvs()
		if len(kvs) == 0 || kvs[0].Lease == ownLease {
			break
		}
		if !b.writesOver(kvs[0].Lease) || attempts > 0 {
			err := b.foreignReference(kvs[0])
			return attempt{}, err
		}
		ownLease = kvs[0].Lease
	}
	kvs := nested.Responses[0].GetResponseRange().GetKvs()
	if len(kvs) > 0 && string(kvs[0].Value) != key && referenceBase(string(kvs[0].Value)) == referenceBase(key) {
		// Another label string that cleans to the same key (x//y and
		// x/./y) owns the references this node would share: neither
		// Cilium's layout nor any other can tell the two apart.
		return attempt{}, fmt.Errorf("%w: its reference keys are those of %q (ID %d) once cleaned as Cilium cleans keys",
			ErrKeyLayout, kvs[0].Value, id)
	}
	if len(kvs) == 0 {
		// References name an ID whose master key is gone; their
		// holders re-create it (master-key protection) or their lease
		// expires. Either way the next create attempt tells.
		return attempt{out: outWait}, nil
	}
	if string(kvs[0].Value) != key {
		// The ID belongs to another label set now (a stale cache entry).
		return attempt{out: outNewID}, nil
	}
	// The master key holds the label set, but its references name
	// another ID, or keys of other label sets share the prefix.
	refKVs := nested.Responses[1].GetResponseRange().GetKvs()
	if len(refKVs) > 0 && isReferenceOf(refKVs[0].Key, refs) && string(refKVs[0].Value) != id.String() {
		refID, err := identity.ParseNumericIdentity(string(refKVs[0].Value))
		if err != nil || refID == identity.InvalidIdentity {
			return attempt{}, fmt.Errorf("reference key %s holds %q, not a numeric identity", refKVs[0].Key, refKVs[0].Value)
		}
		return attempt{out: outAdopt, id: refID}, nil
	}
	ids, rev, err := b.scanReferences(ctx, cli, refs)
	if err != nil {
		return attempt{}, err
	}
	switch len(ids) {
	case 0:
		return attempt{out: outForeign, rev: rev}, nil
	case 1:
		for only := range ids {
			return attempt{out: outAdoptScanned, id: only, rev: rev}, nil
		}
	}
	// Nodes reference the label set under several IDs (written so by
	// racing Cilium agents, say): joining either would keep it so. Wait
	// for the references to agree.
	b.log.Warn("Nodes reference a global label set under several IDs; waiting for them to agree", "labels", key, "ids", ids)
	return attempt{out: outWait}, nil
}

// scanReferences reads the label set's references under prefix and
// returns the IDs they name, with the revision of the read.
func (b *Store) scanReferences(ctx context.Context, cli *clientv3.Client, prefix string) (map[identity.NumericIdentity]int, int64, error) {
	rctx, cancel := b.requestContext(ctx)
	defer cancel()
	resp, err := cli.Get(rctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, 0, err
	}
	ids, err := ReferencedIDs(prefix, resp.Kvs)
	if err != nil {
		return nil, 0, err
	}
	return ids, resp.Header.GetRevision(), nil
}

// writing calls write with the client and the lease to write with, under
// writeMu's read lock, so that a lost lease's restoration never runs in
// the middle of a reference write. wrote is false when no client or
// lease could be had, and write did not run.
func (b *Store) writing(ctx context.Context, write func(*clientv3.Client, clientv3.LeaseID) (attempt, error)) (res attempt, wrote bool, err error) {
	cli := b.kv.Client()
	if cli == nil {
		return attempt{}, false, kvstore.ErrStopped
	}
	lease, err := b.kv.Lease(ctx)
	if err != nil {
		return attempt{}, false, err
	}
	b.writeMu.RLock()
	defer b.writeMu.RUnlock()
	b.noteLease(lease)
	res, err = write(cli, lease)
	return res, true, err
}

func (b *Store) noteLease(lease clientv3.LeaseID) {
	if b.lease.Swap(int64(lease)) != int64(lease) {
		select {
		case b.leaseSeen <- struct{}{}:
		default:
		}
	}
}

// requestContext bounds one request by the kvstore's request timeout (and
// the stop path's deadline, once the agent stops) and makes it fail at once
// on a member that lost its leader, so that the retry reaches a member that
// has one.
func (b *Store) requestContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return b.kv.RequestContext(clientv3.WithRequireLeader(ctx))
}

// heldRefs returns the references this node holds: the allocator's
// record, or nothing once Stop began.
func (b *Store) heldRefs() []*globalstore.Reference {
	var out []*globalstore.Reference
	if b.refs == nil || b.stopped.Load() {
		return nil
	}
	b.refs.Each(func(r *globalstore.Reference) { out = append(out, r) })
	return out
}

// heldRef returns this node's reference to id, or nil.
func (b *Store) heldRef(id identity.NumericIdentity) *globalstore.Reference {
	if b.refs == nil || b.stopped.Load() {
		return nil
	}
	return b.refs.ByID(id)
}

// Release implements globalstore.Backend: it deletes this node's reference
// key, if it is still the write of the revision in ref's token. The token
// is read under writeMu's read lock: a restoration that wrote the key
// again after the allocator dropped ref from its record has stored the
// new revision by then, and no other can start until the delete is sent.
func (b *Store) Release(ctx context.Context, ref *globalstore.Reference) error {
	key := ref.Labels.Canonical()
	b.writeMu.RLock()
	defer b.writeMu.RUnlock()
	if b.stopped.Load() {
		// The lease's revoke in Stop removed the reference with all
		// the others, or its TTL does if etcd is gone.
		return nil
	}
	rev := ref.Token()
	select {
	case <-b.kv.Stopping():
		// The agent is stopping: the lease's revoke removes the
		// reference with all the others, or its TTL does if etcd is
		// gone. A delete would only hold the stop up.
		return nil
	default:
	}
	cli := b.kv.Client()
	if cli == nil {
		return fmt.Errorf("%w: %w", globalstore.ErrUnavailable, kvstore.ErrStopped)
	}
	rctx, cancel := b.requestContext(ctx)
	defer cancel()
	if _, err := releaseTxn(cli.Txn(rctx), referencePrefix(key)+b.node, rev).Commit(); err != nil {
		return fmt.Errorf("%w: deleting reference key of %s: %w", globalstore.ErrUnavailable, key, err)
	}
	return nil
}

// releaseTxn deletes the reference key ref if it is still the write made
// at revision rev (whatever it is when rev is 0). A release's delete may
// reach etcd late: sent to a member that stalled, given up on here, and
// applied when the member resumed, after the label set was allocated
// again and its reference written anew. The compare keeps that newer
// reference; an unconditional delete would leave the node holding an
// identity no reference protects, which another node may then allocate
// a second ID for.
func releaseTxn(txn clientv3.Txn, ref string, rev int64) clientv3.Txn {
	if rev > 0 {
		txn = txn.If(clientv3.Compare(clientv3.ModRevision(ref), "=", rev))
	}
	return txn.Then(clientv3.OpDelete(ref))
}

// retryable tells transient failures (no leader, member down, timeout, lost
// lease) from refusals that another attempt would meet again.
func retryable(err error) bool {
	if errors.Is(err, kvstore.ErrStopped) || errors.Is(err, kvstore.ErrNotStarted) || errors.Is(err, context.Canceled) ||
		errors.Is(err, ErrNodeNameInUse) {
		return false
	}
	if isLeaseNotFound(err) || errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	if s, ok := status.FromError(err); ok {
		switch s.Code() {
		case codes.InvalidArgument, codes.PermissionDenied, codes.Unauthenticated,
			codes.OutOfRange, codes.Unimplemented, codes.AlreadyExists:
			return false
		}
	}
	switch {
	case errors.Is(err, rpctypes.ErrPermissionDenied), errors.Is(err, rpctypes.ErrRequestTooLarge),
		errors.Is(err, rpctypes.ErrTooManyOps), errors.Is(err, rpctypes.ErrAuthFailed):
		return false
	}
	return true
}

func isLeaseNotFound(err error) bool {
	return errors.Is(err, rpctypes.ErrLeaseNotFound) ||
		rpctypes.ErrorDesc(err) == rpctypes.ErrorDesc(rpctypes.ErrGRPCLeaseNotFound)
}

// emit reports the cache's changes to the allocator, and protects master
// keys this node still uses from deletion.
func (b *Store) emit(changes []change) {
	for _, c := range changes {
		if c.upsert {
			b.events.Upsert(c.id, c.lbls)
			continue
		}
		b.events.Delete(c.id, c.lbls)
		b.protect(c.id, c.lbls)
	}
}

// protect queues the re-creation of a deleted master key whose label set
// this node still references: its users would otherwise lose the identity
// to the next allocation of the ID.
func (b *Store) protect(id identity.NumericIdentity, lbls labels.Labels) {
	ref := b.heldRef(id)
	if ref == nil {
		return
	}
	b.log.Warn("Master key of a global identity this node uses was deleted; re-creating it", "id", id, "labels", ref.Labels.Canonical())
	b.lostMu.Lock()
	b.lostMasters[id] = struct{}{}
	b.lostMu.Unlock()
	select {
	case b.repairWake <- struct{}{}:
	default:
	}
}

// repairLoop re-creates this node's keys: all references after the lease
// they lived on was lost, and master keys someone deleted.
func (b *Store) repairLoop(ctx context.Context) {
	var cur clientv3.LeaseID
	// again is set while master keys wait for another attempt; reclaim
	// while the node key does, claims the number of attempts made.
	var again, reclaim <-chan time.Time
	claims := 0
	claim := func() {
		err := b.claimNodeName(ctx)
		switch {
		case err == nil:
			claims, reclaim = 0, nil
			if b.health != nil && !b.conflictSeen.Load() {
				b.health.OK(fmt.Sprintf("Node name %q claimed again after the lease was lost", b.node))
			}
		case ctx.Err() != nil:
			claims, reclaim = 0, nil
		case errors.Is(err, ErrNodeNameInUse):
			// Another live agent's now: the periodic sync reports it.
			claims, reclaim = 0, nil
			b.nameConflict(err)
		default:
			// etcd is not back yet. The key is what keeps a second
			// agent from taking the name: it is claimed as soon as
			// etcd answers, not at the next periodic sync.
			claims++
			if claims == 1 {
				b.log.Warn("Claiming the node name again after the lease was lost failed; retrying", "error", err)
			}
			reclaim = time.After(retry.Backoff(claims))
		}
	}
	for {
		var lost <-chan struct{}
		if cur != 0 {
			lost = b.kv.LeaseLost(cur)
		}
		select {
		case <-ctx.Done():
			return
		case <-again:
			again = nil
			if b.restoreMasters(ctx) {
				again = time.After(time.Second)
			}
		case <-b.leaseSeen:
			cur = clientv3.LeaseID(b.lease.Load())
		case <-lost:
			// The node key went with the lease, or lives on with it
			// for one TTL more if etcd was away and revived it: either
			// way it is claimed on the next lease.
			claims = 0
			claim()
			cur = b.restoreReferences(ctx)
			if reclaim != nil {
				// The references are back: etcd answers again.
				claim()
			}
		case <-reclaim:
			claim()
		case <-b.repairWake:
			if b.restoreMasters(ctx) {
				again = time.After(time.Second)
			}
		}
	}
}

// restoreReferences writes every reference this node holds with a new
// lease, re-creating master keys that vanished meanwhile. It returns the
// lease used, or 0 when nothing is held (the next write grants one).
//
// The allocator's record is read under the write lock: every allocation
// that wrote a reference recorded it before it let go of the read lock,
// and none records one until this ends. A reference the allocator drops
// meanwhile is restored all the same, and its release, waiting for the
// read lock, deletes the restored key by the revision restoreReference
// stored in it.
func (b *Store) restoreReferences(ctx context.Context) clientv3.LeaseID {
	b.writeMu.Lock()
	defer b.writeMu.Unlock()
	for attempt := 1; ctx.Err() == nil; attempt++ {
		held := b.heldRefs()
		if len(held) == 0 {
			b.lease.Store(0)
			return 0
		}
		lease, n, err := b.restoreOnce(ctx, held)
		if err == nil {
			b.lease.Store(int64(lease))
			b.log.Info("Restored this node's identity references with a new lease", "references", n, "lease", fmt.Sprintf("%x", int64(lease)))
			return lease
		}
		b.log.Warn("Restoring this node's identity references failed; retrying", "error", err, "attempt", attempt)
		retry.Sleep(ctx, retry.Backoff(attempt))
	}
	return 0
}

func (b *Store) restoreOnce(ctx context.Context, held []*globalstore.Reference) (clientv3.LeaseID, int, error) {
	cli := b.kv.Client()
	if cli == nil {
		return 0, 0, kvstore.ErrStopped
	}
	lease, err := b.kv.Lease(ctx)
	if err != nil {
		return 0, 0, err
	}
	work := make(chan *globalstore.Reference)
	var (
		errMu    sync.Mutex
		firstErr error
		wg       sync.WaitGroup
	)
	for range min(restoreWorkers, len(held)) {
		wg.Go(func() {
			for ref := range work {
				if _, err := b.restoreReference(ctx, cli, lease, ref); err != nil {
					errMu.Lock()
					firstErr = cmpErr(firstErr, err)
					errMu.Unlock()
				}
			}
		})
	}
	for _, ref := range held {
		work <- ref
	}
	close(work)
	wg.Wait()
	return lease, len(held), firstErr
}

func cmpErr(first, err error) error {
	if first != nil {
		return first
	}
	return err
}

// restoreReference writes one reference of this node, after its keys were
// lost (the lease expired, someone deleted them): if the master key still
// holds the label set, the reference alone; if the master key is gone,
// both. It returns whether it wrote the reference.
//
// While this node's keys were gone, other nodes may have found the label
// set unreferenced and created it again under another ID. This node's
// local users hold the old ID and nothing can take it from them, but
// writing the reference back would make the split visible to every node
// that allocates the label set after, and keep it. So the write compares,
// as adopt does, that no other node references the label set under
// another ID; if one does, this node writes no reference (it keeps the old
// master key from being reused while its users hold the ID), reports the
// conflict, and its next sync writes the reference once the others are
// gone.
//
// A write is stored in ref's token, whether or not the allocator still
// records ref: its release deletes that write then.
func (b *Store) restoreReference(ctx context.Context, cli *clientv3.Client, lease clientv3.LeaseID, held *globalstore.Reference) (bool, error) {
	res, err := b.writeReference(ctx, cli, lease, held)
	if err != nil {
		return false, err
	}
	key := held.Labels.Canonical()
	switch res.out {
	case refForeign:
		b.foreignReference(res.kv)
	case refSplit:
		b.splitConflict(key, held.ID, res.other)
	case refTaken:
		b.idTaken(held.ID, key, res.otherLabels)
	}
	return res.out == refWritten, nil
}

// refOutcome is what writeReference did.
type refOutcome int

const (
	// refWritten: the reference is written (and the master key, if it
	// was missing).
	refWritten refOutcome = iota
	// refForeign: another writer's key is under this node's name (kv).
	refForeign
	// refSplit: other nodes reference the label set under another ID
	// (other); the master key was re-created if missing, no reference
	// written.
	refSplit
	// refTaken: the master key of the ID holds another label set
	// (otherLabels).
	refTaken
)

type refResult struct {
	out         refOutcome
	kv          *mvccpb.KeyValue
	other       identity.NumericIdentity
	otherLabels string
}

// writeReference is restoreReference's writes, without its reports.
func (b *Store) writeReference(ctx context.Context, cli *clientv3.Client, lease clientv3.LeaseID, held *globalstore.Reference) (refResult, error) {
	key, id := held.Labels.Canonical(), held.ID
	master, refs := masterKey(id), referencePrefix(key)
	end := clientv3.GetPrefixRangeEnd(refs)
	own := refs + b.node
	ref := clientv3.OpPut(own, id.String(), clientv3.WithLease(lease))
	for range 3 {
		rctx, cancel := b.requestContext(ctx)
		got, err := cli.Get(rctx, refs, clientv3.WithPrefix())
		cancel()
		if err != nil {
			return refResult{}, fmt.Errorf("restoring reference to %d (%s): %w", id, key, err)
		}
		var other identity.NumericIdentity
		for _, kv := range got.Kvs {
			if string(kv.Key) == own && !b.writesOver(kv.Lease) {
				// Another writer's key under this node's name: this
				// node never writes it (reported, and the other
				// references go on).
				return refResult{out: refForeign, kv: kv}, nil
			}
			if string(kv.Key) == own || !isReferenceOf(kv.Key, refs) || string(kv.Value) == id.String() {
				continue
			}
			if other, err = identity.ParseNumericIdentity(string(kv.Value)); err != nil || other == identity.InvalidIdentity {
				return refResult{}, fmt.Errorf("reference key %s holds %q, not a numeric identity", kv.Key, kv.Value)
			}
			break
		}
		if other != 0 {
			rctx, cancel = b.requestContext(ctx)
			_, err := cli.Txn(rctx).
				If(clientv3.Compare(clientv3.CreateRevision(master), "=", 0)).
				Then(clientv3.OpPut(master, key)).
				Commit()
			cancel()
			return refResult{out: refSplit, other: other}, err
		}
		// Nothing under the prefix changed since the read: no other
		// ID was written meanwhile.
		quiet := clientv3.Compare(clientv3.ModRevision(refs), "<", got.Header.GetRevision()+1).WithRange(end)
		rctx, cancel = b.requestContext(ctx)
		resp, err := cli.Txn(rctx).
			If(clientv3.Compare(clientv3.Value(master), "=", key), quiet).
			Then(ref).
			Else(clientv3.OpTxn(
				[]clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(master), "=", 0), quiet},
				[]clientv3.Op{clientv3.OpPut(master, key), ref},
				[]clientv3.Op{clientv3.OpGet(master)},
			)).Commit()
		cancel()
		if err != nil {
			return refResult{}, fmt.Errorf("restoring reference to %d (%s): %w", id, key, err)
		}
		nested := resp.Responses[0].GetResponseTxn()
		if resp.Succeeded || nested.GetSucceeded() {
			held.SetToken(resp.Header.GetRevision())
			return refResult{out: refWritten}, nil
		}
		if kvs := nested.Responses[0].GetResponseRange().GetKvs(); len(kvs) > 0 && string(kvs[0].Value) != key {
			// The ID was given to another label set while this
			// node's keys were gone. Nothing can make both right;
			// the node keeps using the ID until its users release it.
			return refResult{out: refTaken, otherLabels: string(kvs[0].Value)}, nil
		}
		// References changed under the read: read again.
	}
	return refResult{}, fmt.Errorf("%w: restoring reference to %d (%s): its references kept changing", globalstore.ErrConflict, id, key)
}

// Mirror implements globalstore.Mirror, for the double-write mode that
// decides identities in the Kubernetes API server
// (doublewrite-readcrd): it writes ref's master key when the ID is free
// and ref's reference key on this node's lease, exactly as the repair of
// a lost lease writes them back, so that the GC here sees this node's use
// and the ID stays the label set's for nodes that read etcd. A master key
// of another label set is never written over (ErrIDTaken); while other
// nodes reference the label set under another ID, no reference is written
// (an error: a later call writes it once they released it).
func (b *Store) Mirror(ctx context.Context, ref *globalstore.Reference) error {
	key := ref.Labels.Canonical()
	if err := checkKeyLayout(key); err != nil {
		return fmt.Errorf("writing global identity %d for %s to etcd: %w", ref.ID, key, err)
	}
	_, _, err := b.writing(ctx, func(cli *clientv3.Client, lease clientv3.LeaseID) (attempt, error) {
		if b.stopped.Load() || b.heldRef(ref.ID) != ref {
			// Released meanwhile: writing now would keep the
			// identity alive for as long as the lease lives.
			return attempt{out: outDone}, nil
		}
		res, err := b.writeReference(ctx, cli, lease, ref)
		if err != nil {
			return attempt{}, err
		}
		switch res.out {
		case refForeign:
			return attempt{}, b.foreignReference(res.kv)
		case refSplit:
			return attempt{}, fmt.Errorf("%w: %s is %d on this node, other nodes reference it as %d in etcd; the reference is written once they released it",
				globalstore.ErrConflict, key, ref.ID, res.other)
		case refTaken:
			return attempt{}, fmt.Errorf("%w: %d is %s on this node, %s in etcd", globalstore.ErrIDTaken, ref.ID, key, logtext.Cap(res.otherLabels))
		}
		return attempt{out: outDone}, nil
	})
	if err != nil && !errors.Is(err, globalstore.ErrIDTaken) && !errors.Is(err, globalstore.ErrConflict) && !errors.Is(err, ErrNodeNameInUse) {
		err = fmt.Errorf("%w: writing global identity %d for %s to etcd: %w", globalstore.ErrUnavailable, ref.ID, key, err)
	}
	return err
}

// writesOver tells whether a reference key of this node's name on lease
// is this node's to write over: missing (0), on this node's lease, on an
// earlier lease of this agent (taken for lost while etcd was away, and
// revived by etcd when it came back), or on the lease of the agent of this
// name that was gone when this one took the name over.
func (b *Store) writesOver(lease int64) bool {
	return lease == 0 || lease == b.lease.Load() || lease == b.predecessorLease.Load() ||
		b.kv.Granted(clientv3.LeaseID(lease))
}

// foreignReference reports a reference key under this node's name that
// another writer put there (on a lease not this node's), as a conflict of
// node names, and returns the error for the allocation that found it.
// Cilium's agents suffix their reference keys with their node's IP
// address, identityd's with --node-name: the two meet when a node name is
// a Cilium agent's address. Writing over the key would move it to this
// node's lease, so that this node's stop deleted a reference the other
// writer still has.
func (b *Store) foreignReference(kv *mvccpb.KeyValue) error {
	err := fmt.Errorf("%w: reference key %s was written on lease %x, not by this agent (lease %x); it is left as it is",
		ErrNodeNameInUse, logtext.Cap(string(kv.Key)), kv.Lease, b.lease.Load())
	b.nameConflict(err)
	return err
}

// idTaken reports that the master key of an ID this node uses holds
// another label set: the ID was freed while this node's keys were gone (a
// lease lost for longer than its TTL, then a GC run) and another node gave
// it to that label set, or someone rewrote the key. Other nodes now apply
// that label set's policy to this node's users of the ID, so it is not only
// logged: it is a conflict until a check finds the ID released or its
// master key back.
func (b *Store) idTaken(id identity.NumericIdentity, key, other string) {
	b.conflict(&b.nodeStats.taken, "A global identity this node uses belongs to another label set in etcd",
		"other nodes apply that label set's policy to it until this node's users release it",
		fmt.Errorf("%d: this node %s, etcd %s", id, key, other))
}

// splitConflict reports that other nodes use another ID for a label set
// this node holds.
func (b *Store) splitConflict(key string, id, other identity.NumericIdentity) {
	b.conflict(&b.nodeStats.splits, "A global label set this node uses has another ID on other nodes",
		"this node's reference is not written until they release it",
		fmt.Errorf("%s: this node %d, others %d", key, id, other))
}

// restoreMasters re-creates deleted master keys of label sets this node
// references, with this node's reference in the same transaction, unless
// someone re-created the ID meanwhile. It reports whether some failed and
// are worth another try. Whoever deleted the master key
// (another node's GC) saw no reference; without the reference written
// again the next GC would delete the master key again.
func (b *Store) restoreMasters(ctx context.Context) (retry bool) {
	b.lostMu.Lock()
	ids := make([]identity.NumericIdentity, 0, len(b.lostMasters))
	for id := range b.lostMasters {
		ids = append(ids, id)
	}
	clear(b.lostMasters)
	b.lostMu.Unlock()

	b.writeMu.RLock()
	defer b.writeMu.RUnlock()
	cli := b.kv.Client()
	for _, id := range ids {
		ref := b.heldRef(id)
		if ref == nil || cli == nil {
			continue
		}
		lease, err := b.kv.Lease(ctx)
		if err == nil {
			_, err = b.restoreReference(ctx, cli, lease, ref)
		}
		if err != nil && ctx.Err() == nil {
			b.log.Warn("Re-creating a deleted master key failed; retrying", "id", id, "error", err)
			b.lostMu.Lock()
			b.lostMasters[id] = struct{}{}
			b.lostMu.Unlock()
			retry = true
		}
	}
	return retry
}

// syncTick checks this node's reference keys every --kvstore-periodic-sync
// and writes again those that are missing or not as this node wrote them:
// a second agent with the same node name deletes them when it stops, an
// operator may delete them by hand, and the GC then frees numbers this
// node still uses. (Cilium's agents sync their keys the same way.)
func (b *Store) syncTick(ctx context.Context) error {
	n, err := b.syncReferences(ctx)
	switch {
	case err != nil && ctx.Err() == nil:
		return health.External(fmt.Errorf("checking this node's identity reference keys failed after rewriting %d: %w", n, err))
	case n > 0:
		b.log.Warn("Wrote missing identity reference keys of this node again", "rewritten", n)
	}
	return nil
}

// syncReferences checks every reference key this node holds and writes
// again those that are missing or were written by someone else since this
// node wrote them, re-creating their master keys if these are gone too. It
// returns how many it wrote.
func (b *Store) syncReferences(ctx context.Context) (int, error) {
	cli := b.kv.Client()
	if cli == nil {
		return 0, kvstore.ErrStopped
	}
	b.conflictSeen.Store(false)
	if err := b.checkNodeName(ctx, cli); err != nil {
		return 0, err
	}
	// A stale reference, with the token it had when it was checked.
	type staleRef struct {
		ref *globalstore.Reference
		rev int64
	}
	var stale []staleRef
	held := b.heldRefs()
	for len(held) > 0 {
		batch := held[:min(len(held), syncBatch)]
		held = held[len(batch):]
		// One transaction proves a whole batch unchanged since this node
		// wrote it (each key's mod revision is the one it wrote at). It
		// carries the compares alone, each key once: only when it fails
		// are the batch's keys read, by a second one. (Every node sends
		// this every period: docs/benchmarks.md, "Cluster scale".)
		cmps := make([]clientv3.Cmp, len(batch))
		revs := make([]int64, len(batch))
		for i, h := range batch {
			key := referencePrefix(h.Labels.Canonical()) + b.node
			revs[i] = h.Token()
			cmps[i] = clientv3.Compare(clientv3.ModRevision(key), "=", revs[i])
		}
		rctx, cancel := b.requestContext(ctx)
		resp, err := cli.Txn(rctx).If(cmps...).Commit()
		cancel()
		if err != nil {
			return 0, fmt.Errorf("%w: checking %d reference keys: %w", globalstore.ErrUnavailable, len(batch), err)
		}
		if resp.Succeeded {
			continue
		}
		gets := make([]clientv3.Op, len(batch))
		for i, h := range batch {
			gets[i] = clientv3.OpGet(referencePrefix(h.Labels.Canonical()) + b.node)
		}
		rctx, cancel = b.requestContext(ctx)
		resp, err = cli.Txn(rctx).Then(gets...).Commit()
		cancel()
		if err != nil {
			return 0, fmt.Errorf("%w: reading %d reference keys: %w", globalstore.ErrUnavailable, len(batch), err)
		}
		for i, h := range batch {
			var kvs []*mvccpb.KeyValue
			if i < len(resp.Responses) {
				kvs = resp.Responses[i].GetResponseRange().GetKvs()
			}
			if len(kvs) == 0 || kvs[0].ModRevision != revs[i] || string(kvs[0].Value) != h.ID.String() {
				if len(kvs) > 0 && !b.writesOver(kvs[0].Lease) {
					// Another writer's now: reported, never
					// written over.
					b.foreignReference(kvs[0])
					continue
				}
				stale = append(stale, staleRef{h, revs[i]})
			}
		}
	}
	if len(stale) == 0 {
		b.reportChecked()
		return 0, nil
	}
	// Writing holds writeMu so that no release of these label sets runs
	// meanwhile: a reference written after its release would keep the
	// identity alive for as long as this node's lease lives.
	b.writeMu.Lock()
	defer b.writeMu.Unlock()
	lease, err := b.kv.Lease(ctx)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, st := range stale {
		if b.heldRef(st.ref.ID) != st.ref || st.ref.Token() != st.rev {
			continue // released, or written again, since the check
		}
		wrote, err := b.restoreReference(ctx, cli, lease, st.ref)
		if err != nil {
			return n, err
		}
		if wrote {
			b.nodeStats.rewritten.Add(1)
			n++
		}
	}
	b.reportChecked()
	return n, nil
}

// reportChecked tells health that a check of this node's keys found no
// conflict, if it found none.
func (b *Store) reportChecked() {
	if !b.conflictSeen.Load() && b.health != nil {
		b.health.OK(fmt.Sprintf("Node name %q claimed; reference keys checked", b.node))
	}
}
