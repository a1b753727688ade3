package globalstore

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/cilium/hive/job"

	"github.com/identityd/identityd/cells/health"
)

// Collection is one store's side of its garbage collection, which the
// timer of CollectionJob runs: the store elects the one node of the
// cluster that collects with its own campaign (an etcd election key, a
// Kubernetes Lease), and decides and deletes with its own pass.
type Collection struct {
	// What names the collected objects in the job's errors.
	What string
	// Ready reports whether the store can collect now: its first
	// listing is complete and it is not stopping.
	Ready func() bool
	// Term returns the context of this node's term as the elected
	// collector, which ends with the term; nil while another node
	// collects.
	Term func() context.Context
	// Idle, when set, runs at a tick while another node collects.
	Idle func(ctx context.Context)
	// Pass is one collection, bounded by ctx, which ends with the term.
	Pass func(ctx context.Context) (GCResult, error)
}

// CollectionJob returns the timer job named name that runs c every
// interval: while the store is ready and this node holds a term, one pass
// bounded by the term. A pass that fails is the store's doing, not the
// agent's (health.External: readiness, not liveness); one that did
// something is logged (gcLog).
func CollectionJob(name string, interval time.Duration, log *slog.Logger, c Collection) job.Job {
	var logged gcLog
	return job.Timer(name, func(ctx context.Context) error {
		if !c.Ready() {
			return nil
		}
		term := c.Term()
		if term == nil {
			if c.Idle != nil {
				c.Idle(ctx)
			}
			return nil
		}
		// The pass runs in a child of the term, which the term's end
		// cancels before the election reports it ended: no write of
		// the pass starts once this node no longer holds the term. The
		// job's stop reaches it through AfterFunc.
		run, cancel := context.WithCancel(term)
		defer cancel()
		defer context.AfterFunc(ctx, cancel)()
		ctx = run
		res, err := c.Pass(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return health.External(fmt.Errorf("garbage collection of %s failed after %d deletions: %w", c.What, res.Deleted, err))
		}
		logged.Log(log, res)
		return nil
	}, interval)
}

// gcLog logs collection passes: one that marked, deleted, unmarked or
// deferred something, or deleted an IdentityNode, at info level; one that
// only skipped objects at info level when the number changes and at debug
// level when it repeats, so that objects another writer keeps using do not
// repeat the same line every pass.
type gcLog struct{ lastSkipped atomic.Int64 }

// Log logs res to log.
func (l *gcLog) Log(log *slog.Logger, res GCResult) {
	last := l.lastSkipped.Swap(int64(res.Skipped))
	level := slog.LevelInfo
	switch {
	case res.Marked > 0 || res.Deleted > 0 || res.Unmarked > 0 || res.Deferred > 0 || res.NodesDeleted > 0:
	case res.Skipped > 0 && int64(res.Skipped) != last:
	case res.Skipped > 0:
		level = slog.LevelDebug
	default:
		return
	}
	log.Log(context.Background(), level, "Garbage collection of global identities",
		"marked", res.Marked, "deleted", res.Deleted, "skipped", res.Skipped, "deferred", res.Deferred,
		"unmarked", res.Unmarked, "keptUsed", res.KeptUsed, "keptFenced", res.KeptFenced, "identityNodesDeleted", res.NodesDeleted)
}
