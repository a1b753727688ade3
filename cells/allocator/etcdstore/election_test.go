package etcdstore

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/eventually"
	"github.com/identityd/identityd/labels"
)

// TestEtcdCollectorElection: of two nodes with a GC interval, exactly one
// collects. When its term ends under it (its election key deleted), it
// stops collecting, a delete of the ended term deletes nothing, and the
// other node collects; a clean stop hands the collection over at once.
func TestEtcdCollectorElection(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := c.Client(t)
	withGC := func(_ *kvstore.Config, e *storeConfig) {
		// Campaigns, but the timer's runs are the test's own.
		e.IdentityGCInterval = time.Hour
		e.IdentityGCRateLimit = 1_000_000
	}
	n1 := startEtcdNode(t, c, "node1", withGC)
	n2 := startEtcdNode(t, c, "node2", withGC)
	nodes := []*etcdNode{n1, n2}
	collecting := func() []*etcdNode {
		var out []*etcdNode
		for _, n := range nodes {
			if n.backend.Collecting() {
				out = append(out, n)
			}
		}
		return out
	}
	eventually.True(t, "one node collects", func() bool { return len(collecting()) == 1 })
	leader := collecting()[0]
	other := n1
	if leader == n1 {
		other = n2
	}
	ctx := testCtx(t, time.Minute)
	other.backend.refreshCollector(ctx, cli)
	if name, ok := other.backend.Collector(); !ok || name != leader.name {
		t.Errorf("%s sees %q (%v) collecting, want %s", other.name, name, ok, leader.name)
	}

	// An unreferenced master key, in the caches.
	orphan := identity.NumericIdentity(60000)
	if _, err := cli.Put(ctx, masterKey(orphan), labels.MustParse("k8s:app=orphan").Canonical()); err != nil {
		t.Fatal(err)
	}
	eventually.True(t, "caches hold the orphan", func() bool {
		_, ok1 := leader.backend.LookupByID(orphan)
		_, ok2 := other.backend.LookupByID(orphan)
		return ok1 && ok2
	})

	term := leader.backend.collector.term.Load()
	if term == nil {
		t.Fatal("no term")
	}
	if _, err := cli.Delete(ctx, term.key); err != nil {
		t.Fatal(err)
	}
	eventually.True(t, "the other node collects alone", func() bool {
		c := collecting()
		return len(c) == 1 && c[0] == other
	})
	if _, _, err := leader.backend.runGC(ctx, term); !errors.Is(err, errNotCollector) {
		t.Errorf("a run of the ended term: %v, want %v", err, errNotCollector)
	}
	if _, _, ok := getValue(t, cli, masterKey(orphan)); !ok {
		t.Fatal("a run of the ended term deleted the orphan")
	}
	deleted, _, err := other.backend.runGC(ctx, other.backend.collector.term.Load())
	if err != nil || deleted != 1 {
		t.Errorf("the new collector's run: deleted %d, %v; want 1", deleted, err)
	}

	// A clean stop revokes the lease and with it the election key.
	stopped := time.Now()
	other.stop()
	nodes = []*etcdNode{leader}
	eventually.True(t, "the remaining node collects", func() bool { return leader.backend.Collecting() })
	if took := time.Since(stopped); took > 10*time.Second {
		t.Errorf("handover after a clean stop took %s", took)
	}
}

// TestGCLogOnChange: a run that only skipped keys (foreign keys another
// writer keeps referencing) is logged at info level when the count
// changes, and at debug level when it repeats; a run that deleted is
// always logged at info level.
func TestGCLogOnChange(t *testing.T) {
	var rec levelRecorder
	b := &Store{log: slog.New(&rec)}
	for _, run := range []struct{ deleted, skipped int }{{0, 3}, {0, 3}, {0, 3}, {0, 4}, {1, 4}, {0, 0}} {
		b.logGCRun(run.deleted, run.skipped)
	}
	want := []slog.Level{slog.LevelInfo, slog.LevelDebug, slog.LevelDebug, slog.LevelInfo, slog.LevelInfo}
	if !slices.Equal(rec.levels, want) {
		t.Errorf("log levels %v, want %v", rec.levels, want)
	}
}

type levelRecorder struct{ levels []slog.Level }

func (r *levelRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (r *levelRecorder) Handle(_ context.Context, rec slog.Record) error {
	r.levels = append(r.levels, rec.Level)
	return nil
}
func (r *levelRecorder) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *levelRecorder) WithGroup(string) slog.Handler      { return r }
