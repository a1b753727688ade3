package crdstore

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/idprobe"
	"github.com/identityd/identityd/labels"
)

// levelRecords records every log record's level and message.
type levelRecords struct {
	mu   sync.Mutex
	recs []slog.Record
}

func (r *levelRecords) Enabled(context.Context, slog.Level) bool { return true }
func (r *levelRecords) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.recs = append(r.recs, rec)
	return nil
}
func (r *levelRecords) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *levelRecords) WithGroup(string) slog.Handler      { return r }

// count is the number of records at level whose message contains sub.
func (r *levelRecords) count(level slog.Level, sub string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, rec := range r.recs {
		if rec.Level == level && strings.Contains(rec.Message, sub) {
			n++
		}
	}
	return n
}

// TestDuplicateLogLevel: a label set with a second object that identityd's
// walk did not place (a Cilium agent's, at a random ID) is logged once, at
// info level, and counted in identityd_crd_split_label_sets_foreign_total,
// however often its objects change or are listed again; a label set with
// two objects both on its probe sequence (two identityd nodes disagreed)
// is logged at error level and not counted as foreign. Before, every
// duplicate was an error line, on every node.
func TestDuplicateLogLevel(t *testing.T) {
	cluster := identity.ClusterInfo{Name: "default"}
	rec := &levelRecords{}
	c := newIdentityCache(slog.New(rec), cluster, cacheHooks{})
	now := time.Now().Truncate(time.Second)
	const sets = 50
	var objs []any
	for i := range sets {
		l := labels.MustParse(fmt.Sprintf("k8s:app=mixed-%d", i))
		p := idprobe.New(l.Canonical(), cluster)
		// identityd's object at the start of the sequence; the Cilium
		// agent's at a random ID, far along the sequence with free
		// slots before it.
		objs = append(objs, object(p.Slot(0), l, now), object(p.Slot(3000), l, now.Add(time.Second)))
	}
	if err := c.Replace(objs, "1"); err != nil {
		t.Fatal(err)
	}
	const dup = "has a second CiliumIdentity object"
	check := func(when string) {
		t.Helper()
		if got := rec.count(slog.LevelInfo, dup); got != sets {
			t.Errorf("%s: %d info lines for %d label sets duplicated by a Cilium agent, want one per set", when, got, sets)
		}
		if got := rec.count(slog.LevelError, ""); got != 0 {
			t.Errorf("%s: %d error lines for duplicates a Cilium agent made, want none", when, got)
		}
		expectSamples(t, samples(t, &Store{ids: c}), map[string]float64{
			"identityd_crd_split_label_sets_foreign_total": sets,
			"identityd_crd_split_label_sets_total":         sets,
		})
	}
	check("first listing")
	// The same objects listed again and changed (a heartbeat mark, say):
	// no new line, no new count.
	if err := c.Replace(objs, "2"); err != nil {
		t.Fatal(err)
	}
	for _, o := range objs {
		marked := o.(*CiliumIdentity).DeepCopy()
		marked.ResourceVersion = "3"
		marked.Annotations = map[string]string{HeartbeatAnnotation: now.Format(time.RFC3339)}
		if err := c.Update(marked); err != nil {
			t.Fatal(err)
		}
	}
	check("relisted and updated")

	// Two objects both where identityd's walk places them: an error.
	l := labels.MustParse("k8s:app=identityd-split")
	p := idprobe.New(l.Canonical(), cluster)
	if err := c.Add(object(p.Slot(0), l, now)); err != nil {
		t.Fatal(err)
	}
	if err := c.Add(object(p.Slot(1), l, now)); err != nil {
		t.Fatal(err)
	}
	if got := rec.count(slog.LevelError, "placed by identityd nodes"); got != 1 {
		t.Errorf("%d error lines for a label set two identityd nodes placed twice, want 1", got)
	}
	if got := c.foreignSplits.Load(); got != sets {
		t.Errorf("a duplicate identityd placed counted as foreign: %d, want %d", got, sets)
	}
	if got := c.splitsTotal.Load(); got != sets+1 {
		t.Errorf("splits counted %d, want %d", got, sets+1)
	}
}
