package globalstore

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"

	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/internal/eventually"
)

// TestGCLogOnChange: a pass that only skipped objects (another writer
// keeps using them) is logged at info level when the count changes, and
// at debug level when it repeats; a pass that deleted or marked is always
// logged at info level, and one that did nothing is not logged.
func TestGCLogOnChange(t *testing.T) {
	rec := &levelRecorder{}
	log := slog.New(rec)
	var l gcLog
	for _, res := range []GCResult{{Skipped: 3}, {Skipped: 3}, {Skipped: 3}, {Skipped: 4}, {Deleted: 1, Skipped: 4}, {Marked: 2}, {}} {
		l.Log(log, res)
	}
	want := []slog.Level{slog.LevelInfo, slog.LevelDebug, slog.LevelDebug, slog.LevelInfo, slog.LevelInfo, slog.LevelInfo}
	if got := rec.get(); !slices.Equal(got, want) {
		t.Errorf("log levels %v, want %v", got, want)
	}
}

type levelRecorder struct {
	mu     sync.Mutex
	levels []slog.Level
}

func (r *levelRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (r *levelRecorder) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	r.levels = append(r.levels, rec.Level)
	r.mu.Unlock()
	return nil
}
func (r *levelRecorder) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *levelRecorder) WithGroup(string) slog.Handler      { return r }
func (r *levelRecorder) get() []slog.Level {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.levels)
}

// TestCollectionJob: the job collects only once the store is ready and
// while this node holds a term, ticks Idle while another node collects,
// and a pass ends when the term does.
func TestCollectionJob(t *testing.T) {
	var (
		ready         atomic.Bool
		term          atomic.Pointer[context.Context]
		passes, idles atomic.Int64
		ended         = make(chan error, 1)
		blockNextPass atomic.Bool
	)
	c := Collection{
		What:  "test objects",
		Ready: ready.Load,
		Term: func() context.Context {
			if p := term.Load(); p != nil {
				return *p
			}
			return nil
		},
		Idle: func(context.Context) { idles.Add(1) },
		Pass: func(ctx context.Context) (GCResult, error) {
			passes.Add(1)
			if blockNextPass.CompareAndSwap(true, false) {
				<-ctx.Done()
				ended <- ctx.Err()
				return GCResult{}, ctx.Err()
			}
			return GCResult{}, nil
		},
	}
	h := hive.New(job.Cell, cell.Invoke(func(r job.Registry) {
		g := r.NewGroup(health.OrDetached(nil))
		g.Add(CollectionJob("test-gc", 5*time.Millisecond, slog.New(slog.DiscardHandler), c))
	}))
	log := hivetest.Logger(t)
	if err := h.Start(log, t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Stop(log, context.Background()) })

	time.Sleep(50 * time.Millisecond)
	if passes.Load() != 0 || idles.Load() != 0 {
		t.Fatalf("before the store was ready: %d passes, %d idle ticks", passes.Load(), idles.Load())
	}
	ready.Store(true)
	eventually.True(t, "ticks while another node collects are idle", func() bool { return idles.Load() > 2 })
	if passes.Load() != 0 {
		t.Fatalf("%d passes without a term", passes.Load())
	}
	termCtx, endTerm := context.WithCancel(context.Background())
	blockNextPass.Store(true)
	term.Store(&termCtx)
	eventually.True(t, "a term's ticks collect", func() bool { return passes.Load() > 0 })
	endTerm()
	select {
	case err := <-ended:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("the pass ended with %v", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("the pass did not end with the term")
	}
}
