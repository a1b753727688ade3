package doublewrite

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/retry"
	"github.com/identityd/identityd/labels"
)

// Backend is the globalstore.Backend of a double-write mode: the read
// store decides, the write-only store mirrors (see the package
// documentation).
type Backend struct {
	log  *slog.Logger
	mode identity.AllocationMode
	cfg  Config
	// read decides IDs; write mirrors them.
	read, write globalstore.Mirror
	// views follow the two stores' caches, by pure mode.
	views map[identity.AllocationMode]*view

	refs globalstore.References

	// pending holds the references whose mirror write failed or found
	// the ID taken, by ID, for the retry job; taken those of them whose
	// last attempt found the ID taken, with the error.
	mu      sync.Mutex
	pending map[identity.NumericIdentity]*globalstore.Reference
	taken   map[identity.NumericIdentity]error
	wake    chan struct{}

	stats struct {
		written, takenTotal, failed atomic.Uint64
	}
	// report is the last comparison of the two stores, nil while this
	// node does not report.
	report atomic.Pointer[Report]

	// gcElection: the read store elects a collector
	// (--identity-gc-interval above 0).
	gcElection bool

	jobs     job.Group
	health   cell.Health // the conflicts' scope; nil outside a hive
	stopping atomic.Bool
}

var _ globalstore.Backend = (*Backend)(nil)

// newDoubleWrite returns the Backend of mode (a double-write mode) over the two
// stores, by pure mode; its loops run in jobs.
func newDoubleWrite(log *slog.Logger, mode identity.AllocationMode, cluster identity.ClusterInfo, cfg Config, stores map[identity.AllocationMode]globalstore.Mirror, jobs job.Group) (*Backend, error) {
	if !mode.DoubleWrite() {
		return nil, fmt.Errorf("%q is not a double-write mode", mode)
	}
	read, write := stores[mode.ReadStore()], stores[mode.WriteOnlyStore()]
	if read == nil || write == nil {
		return nil, fmt.Errorf("--identity-allocation-mode=%s needs both stores of global identities (etcd: kvstore.Cell with etcdstore.Cell; CRDs: k8sclient.Cell with crdstore.Cell)", mode)
	}
	return &Backend{
		log:  log,
		mode: mode,
		cfg:  cfg,
		read: read, write: write,
		views: map[identity.AllocationMode]*view{
			identity.AllocationModeKVStore: newView(cluster),
			identity.AllocationModeCRD:     newView(cluster),
		},
		pending: map[identity.NumericIdentity]*globalstore.Reference{},
		taken:   map[identity.NumericIdentity]error{},
		wake:    make(chan struct{}, 1),
		jobs:    jobs,
	}, nil
}

// Mode returns the double-write mode served.
func (b *Backend) Mode() identity.AllocationMode { return b.mode }

// register binds the two stores' Sinks to the comparison of the stores,
// the read store's reporting on to the allocator's (the Sink of the
// double-write mode), and adds the jobs that retry failed mirror writes
// and compare the stores. The stores start before with their own hooks:
// both must start, as a node that cannot reach one of them does not serve
// in a double-write mode.
func (b *Backend) register(lc cell.Lifecycle, sinks *globalstore.Sinks) {
	out := sinks.For(b.mode)
	b.refs = out
	rv, wv := b.views[b.mode.ReadStore()], b.views[b.mode.WriteOnlyStore()]
	rv.next = out
	sinks.For(b.mode.ReadStore()).Bind(rv, out)
	sinks.For(b.mode.WriteOnlyStore()).Bind(wv, out)
	b.jobs.Add(job.OneShot("doublewrite-retry", func(ctx context.Context, h cell.Health) error {
		b.retryLoop(ctx)
		return nil
	}))
	if b.cfg.DoubleWriteMetricReporterInterval > 0 {
		b.jobs.Add(job.Timer("doublewrite-metric-reporter", func(ctx context.Context) error {
			b.compareIfCollecting()
			return nil
		}, b.cfg.DoubleWriteMetricReporterInterval))
	}
	// After the jobs: its stop comes first, so that no mirror write
	// failing in the stop is queued for a retry that no longer runs.
	lc.Append(cell.Hook{
		OnStart: func(cell.HookContext) error { b.reportHealth(); return nil },
		OnStop:  func(cell.HookContext) error { b.stopping.Store(true); return nil },
	})
}

// LookupByID implements globalstore.Backend from the read store.
func (b *Backend) LookupByID(id identity.NumericIdentity) (labels.Labels, bool) {
	return b.read.LookupByID(id)
}

// LookupByLabels implements globalstore.Backend from the read store.
func (b *Backend) LookupByLabels(lbls labels.Labels) (identity.NumericIdentity, bool) {
	return b.read.LookupByLabels(lbls)
}

// Allocate implements globalstore.Backend: the read store allocates as in
// its own mode, then the write-only store gets the same ID and label set
// (Mirror). A failure of the write-only store does not fail the
// allocation: it is reported and retried.
func (b *Backend) Allocate(ctx context.Context, lbls labels.Labels, record func(*globalstore.Reference)) (identity.NumericIdentity, bool, error) {
	var ref *globalstore.Reference
	id, created, err := b.read.Allocate(ctx, lbls, func(r *globalstore.Reference) {
		ref = r
		record(r)
	})
	if err != nil {
		return id, created, err
	}
	if created {
		b.views[b.mode.ReadStore()].note(id, lbls)
	}
	if ref != nil {
		b.mirror(ctx, ref)
	}
	return id, created, nil
}

// Adopt implements globalstore.Backend: the read store adopts, and the
// write-only store gets the same ID and label set, as after Allocate.
func (b *Backend) Adopt(ctx context.Context, lbls labels.Labels, record func(*globalstore.Reference)) (identity.NumericIdentity, error) {
	var ref *globalstore.Reference
	id, err := b.read.Adopt(ctx, lbls, func(r *globalstore.Reference) {
		ref = r
		record(r)
	})
	if err != nil {
		return id, err
	}
	if ref != nil {
		b.mirror(ctx, ref)
	}
	return id, nil
}

// mirror writes ref to the write-only store, and keeps it for the retry
// job when that fails.
func (b *Backend) mirror(ctx context.Context, ref *globalstore.Reference) {
	err := b.write.Mirror(ctx, ref)
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.refs != nil && b.refs.ByID(ref.ID) != ref {
		// Released meanwhile.
		delete(b.pending, ref.ID)
		delete(b.taken, ref.ID)
		return
	}
	switch {
	case err == nil:
		b.stats.written.Add(1)
		delete(b.pending, ref.ID)
		if _, was := b.taken[ref.ID]; was {
			delete(b.taken, ref.ID)
			b.log.Info("Global identity written to the write-only store, whose ID another label set held before", "id", ref.ID, "store", b.mode.WriteOnlyStore())
			b.reportHealthLocked()
		}
	case errors.Is(err, globalstore.ErrIDTaken):
		b.pending[ref.ID] = ref
		if _, was := b.taken[ref.ID]; !was {
			b.stats.takenTotal.Add(1)
			b.log.Error("Global identity not written to the write-only store: its ID belongs to another label set there; nodes that read that store apply the other label set's policy to it",
				"id", ref.ID, "store", b.mode.WriteOnlyStore(), "error", err)
		}
		b.taken[ref.ID] = err
		b.reportHealthLocked()
	default:
		b.stats.failed.Add(1)
		if _, was := b.pending[ref.ID]; !was && !b.stopping.Load() {
			b.log.Warn("Writing a global identity to the write-only store failed; retrying", "id", ref.ID, "labels", ref.Labels.Canonical(),
				"store", b.mode.WriteOnlyStore(), "error", err)
		}
		b.pending[ref.ID] = ref
		select {
		case b.wake <- struct{}{}:
		default:
		}
	}
}

// Release implements globalstore.Backend: the read store's release is the
// one that counts; the write-only store's failure is logged (its record of
// this node's uses no longer lists the identity once written again).
func (b *Backend) Release(ctx context.Context, ref *globalstore.Reference) error {
	b.mu.Lock()
	if b.pending[ref.ID] == ref {
		delete(b.pending, ref.ID)
		if _, was := b.taken[ref.ID]; was {
			delete(b.taken, ref.ID)
			b.reportHealthLocked()
		}
	}
	b.mu.Unlock()
	err := b.read.Release(ctx, ref)
	if werr := b.write.Release(ctx, ref); werr != nil {
		b.log.Warn("Releasing a global identity in the write-only store failed", "id", ref.ID, "store", b.mode.WriteOnlyStore(), "error", werr)
	}
	return err
}

// retryLoop writes the pending references again: at once after a new
// failure, then with a growing pause while some fail, and every
// maxRetryPause while IDs stay taken (another label set's identity may be
// deleted there meanwhile).
func (b *Backend) retryLoop(ctx context.Context) {
	const maxRetryPause = 30 * time.Second
	failures := 0
	for {
		var pause <-chan time.Time
		b.mu.Lock()
		n := len(b.pending)
		b.mu.Unlock()
		if n > 0 {
			pause = time.After(min(retry.Backoff(failures+1), maxRetryPause))
		}
		select {
		case <-ctx.Done():
			return
		case <-b.wake:
			retry.Sleep(ctx, retry.Backoff(failures+1))
		case <-pause:
		}
		b.mu.Lock()
		refs := slices.Collect(maps.Values(b.pending))
		b.mu.Unlock()
		for _, ref := range refs {
			if ctx.Err() != nil {
				return
			}
			b.mirror(ctx, ref)
		}
		b.mu.Lock()
		if len(b.pending) > len(b.taken) {
			failures++
		} else {
			failures = 0
		}
		b.mu.Unlock()
	}
}

// WriteStats counts the writes to the write-only store.
type WriteStats struct {
	// Written: writes that succeeded (the identity was created, or found
	// with its label set).
	Written uint64
	// TakenTotal: references whose ID was found given to another label
	// set in the write-only store (each once until written or released).
	TakenTotal uint64
	// Failed: writes that failed and were left to a retry.
	Failed uint64
	// Taken and Pending: references whose ID is taken now, and those
	// waiting for a retry now (taken ones included).
	Taken, Pending int
}

// WriteStats returns the counters of the writes to the write-only store.
func (b *Backend) WriteStats() WriteStats {
	b.mu.Lock()
	defer b.mu.Unlock()
	return WriteStats{
		Written: b.stats.written.Load(), TakenTotal: b.stats.takenTotal.Load(), Failed: b.stats.failed.Load(),
		Taken: len(b.taken), Pending: len(b.pending),
	}
}

func (b *Backend) reportHealth() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.reportHealthLocked()
}

// reportHealthLocked reports the taken IDs as degraded (not ready, still
// live: this node's users decide when they release them), else OK.
func (b *Backend) reportHealthLocked() {
	if b.health == nil {
		return
	}
	if len(b.taken) > 0 {
		ids := slices.Sorted(maps.Keys(b.taken))
		errs := make([]error, 0, min(len(ids), 5))
		for _, id := range ids[:min(len(ids), 5)] {
			errs = append(errs, b.taken[id])
		}
		b.health.Degraded(fmt.Sprintf("%d global identities this node uses have their ID given to another label set in the write-only store (%s)", len(ids), b.mode.WriteOnlyStore()),
			health.External(errors.Join(errs...)))
		return
	}
	b.health.OK(fmt.Sprintf("Reading %s, writing %s too", b.mode.ReadStore(), b.mode.WriteOnlyStore()))
}
