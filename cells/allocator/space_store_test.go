package allocator_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/eventually"
	"github.com/identityd/identityd/internal/metricstest"
	"github.com/identityd/identityd/internal/testhive"
	"github.com/identityd/identityd/labels"
)

// warnings keeps the warnings about the global identity space that the
// hive logs, and passes every record on to the test's log.
type warnings struct {
	slog.Handler
	mu   *sync.Mutex
	msgs *[]string
}

func (w warnings) Handle(ctx context.Context, r slog.Record) error {
	if r.Level >= slog.LevelWarn && strings.Contains(r.Message, "Global identity space") {
		w.mu.Lock()
		*w.msgs = append(*w.msgs, r.Message)
		w.mu.Unlock()
	}
	return w.Handler.Handle(ctx, r)
}

func (w warnings) WithAttrs(as []slog.Attr) slog.Handler {
	return warnings{w.Handler.WithAttrs(as), w.mu, w.msgs}
}

func (w warnings) WithGroup(name string) slog.Handler {
	return warnings{w.Handler.WithGroup(name), w.mu, w.msgs}
}

// TestSpaceExhaustedEtcd: the etcd store's range filled to 90%, then to
// the last ID (master keys written as other nodes write them), then
// partly freed: the identity-space health scope is degraded with the fill
// from 90% and at exhaustion, with one warning in the log at each change
// of state (up, and down from exhausted to nearly full); a new label set is refused in under 10 ms and the refusal
// counter moves; the health is OK again once the fill is below 90%.
// Without the allocator's watch of the range, health stays OK, nothing is
// logged and no counter moves (checked).
func TestSpaceExhaustedEtcd(t *testing.T) {
	var (
		alloc  allocator.Allocator
		prov   *health.Provider
		server *metrics.Server
		kv     *kvstore.Client
	)
	h := hive.New(
		health.Cell, metrics.Cell, job.Cell, statedb.Cell, statedir.Cell,
		kvstore.Cell, allocator.Cell, etcdstore.Cell,
		cell.Invoke(func(a allocator.Allocator, p *health.Provider, s *metrics.Server, c *kvstore.Client) {
			alloc, prov, server, kv = a, p, s, c
		}),
	)
	dir := t.TempDir()
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(h, func(c *metrics.Config) { c.PrometheusServeAddr = "127.0.0.1:0" })
	hive.AddConfigOverride(h, func(c *globalstore.Config) { c.IdentityGCInterval = 0 })
	var (
		mu   sync.Mutex
		msgs []string
	)
	log := slog.New(warnings{hivetest.Logger(t, hivetest.LogLevel(slog.LevelInfo)).Handler(), &mu, &msgs})
	if _, err := testhive.TryStart(t, h, log); err != nil {
		t.Fatal(err)
	}
	cli := kv.Client()
	cluster := identity.ClusterInfo{Name: "default"}
	lo, hi := cluster.MinID(), cluster.MaxID()
	size := int(hi-lo) + 1
	const prefix = "cilium/state/identities/v1/id/"
	// write puts (or deletes) the master keys of IDs from..to.
	write := func(from, to identity.NumericIdentity, put bool) {
		t.Helper()
		var ops []clientv3.Op
		flush := func() {
			if _, err := cli.Txn(t.Context()).Then(ops...).Commit(); err != nil {
				t.Fatal(err)
			}
			ops = ops[:0]
		}
		for id := from; id <= to; id++ {
			k := prefix + id.String()
			if put {
				ops = append(ops, clientv3.OpPut(k, fmt.Sprintf("k8s:app=fill-%d;", id)))
			} else {
				ops = append(ops, clientv3.OpDelete(k))
			}
			if len(ops) == 100 {
				flush()
			}
		}
		if len(ops) > 0 {
			flush()
		}
	}
	space := func() health.Status {
		for _, s := range prov.All() {
			if strings.HasSuffix(s.Name, "identity-space") {
				return s
			}
		}
		t.Fatal("no identity-space health scope")
		return health.Status{}
	}
	warned := func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), msgs...)
	}
	waitSpace := func(what string, level cell.Level, text string) {
		t.Helper()
		eventually.True(t, what, func() bool {
			s := space()
			return s.Level == level && strings.Contains(s.Message, text)
		})
	}

	if s := space(); s.Level != cell.StatusOK {
		t.Fatalf("identity-space %s %q in an empty range", s.Level, s.Message)
	}
	nearly := lo + identity.NumericIdentity(size*9/10)
	write(lo, nearly-2, true)
	time.Sleep(time.Second)
	if s := space(); s.Level != cell.StatusOK || len(warned()) != 0 {
		t.Fatalf("just below 90%%: identity-space %s %q, warnings %q", s.Level, s.Message, warned())
	}
	write(nearly-1, nearly+100, true)
	// Degraded in its message, still OK (ready): every node can serve.
	waitSpace("identity-space degraded at 90%", cell.StatusOK, "Degraded, serving: Global identity space 90.")
	if w := warned(); len(w) != 1 || !strings.Contains(w[0], "nearly full") {
		t.Fatalf("warnings at 90%%: %q, want one", w)
	}
	write(nearly+101, hi, true)
	waitSpace("identity-space exhausted", cell.StatusOK, "Degraded, serving: Global identity space exhausted")
	if w := warned(); len(w) != 2 || !strings.Contains(w[1], "exhausted") {
		t.Fatalf("warnings at exhaustion: %q, want one more", w)
	}
	for i := range 5 {
		start := time.Now()
		_, _, err := alloc.Allocate(t.Context(), labels.MustParse(fmt.Sprintf("k8s:app=refused-%d", i)))
		if d := time.Since(start); !errors.Is(err, globalstore.ErrSpaceExhausted) || d > 10*time.Millisecond {
			t.Fatalf("allocation in the full range: %v after %s, want ErrSpaceExhausted within 10ms", err, d)
		}
	}
	if w := warned(); len(w) != 2 {
		t.Fatalf("warnings after refusals: %q, want no more", w)
	}
	metricstest.Expect(t, metricstest.Scrape(t, server.Addr()), map[string]float64{
		`identityd_identity_space_exhausted_total`:             5,
		`identityd_identity_space_exhaustion_forecast_seconds`: 0,
	})
	// Freed below 90%: OK again.
	write(nearly-500, hi, false)
	eventually.True(t, "identity-space OK below 90%", func() bool {
		s := space()
		return s.Level == cell.StatusOK && strings.HasPrefix(s.Message, "Global identity space") && strings.Contains(s.Message, "full")
	})
	// One warning per change: exhausted to nearly full on the way down.
	if w := warned(); len(w) != 3 || !strings.Contains(w[2], "nearly full") {
		t.Fatalf("warnings after the release: %q, want one more, for the change back to nearly full", w)
	}
	if _, _, err := alloc.Allocate(t.Context(), labels.MustParse("k8s:app=fits")); err != nil {
		t.Fatal(err)
	}
}
