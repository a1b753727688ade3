package restoration_test

import (
	"context"
	"log/slog"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/checkpoint"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/cells/restoration"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/internal/ipcachemap"
)

// errorRecords keeps the error records logged, with when they came.
type errorRecords struct {
	mu      sync.Mutex
	records []slog.Record
}

func (h *errorRecords) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelError }
func (h *errorRecords) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.records = append(h.records, r.Clone())
	return nil
}
func (h *errorRecords) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *errorRecords) WithGroup(string) slog.Handler      { return h }

// find returns the first record whose message has sub, with its caller
// attribute.
func (h *errorRecords) find(sub string) (slog.Record, string, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, r := range h.records {
		if strings.Contains(r.Message, sub) {
			caller := ""
			r.Attrs(func(a slog.Attr) bool {
				if a.Key == "caller" {
					caller = a.Value.String()
				}
				return true
			})
			return r, caller, true
		}
	}
	return slog.Record{}, "", false
}

// TestEarlyAllocationLogged: a cell whose start hook allocates a local
// identity without depending on the Restorer runs before restoration's
// start hook and keeps it from running. That is logged within a second,
// naming the caller and the fix, rather than waited out silently for the
// whole allocation bound.
func TestEarlyAllocationLogged(t *testing.T) {
	logs := &errorRecords{}
	early := cell.Invoke(func(lc cell.Lifecycle, a allocator.Allocator) {
		lc.Append(cell.Hook{OnStart: func(hctx cell.HookContext) error {
			ctx, cancel := context.WithTimeout(hctx, 4*time.Second)
			defer cancel()
			_, _, err := a.Allocate(ctx, labelsOf(netip.MustParsePrefix("10.1.0.0/16")))
			return err
		}})
	})
	h := hive.New(
		cell.SimpleHealthCell, job.Cell, statedb.Cell, statedir.Cell,
		early, // before the allocator's invoke, which places restoration's hook
		allocator.Cell, checkpoint.Cell, ipcache.Cell, restoration.Cell,
	)
	dir := t.TempDir()
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(h, func(c *ipcache.Config) { c.IPCacheMap = string(ipcachemap.KindFile) })
	log := slog.New(logs)
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := h.Start(log, ctx)
	h.Stop(log, context.Background())
	if err == nil {
		t.Fatal("the start hook's allocation did not fail: restoration ran before it, so the test shows nothing")
	}
	r, caller, ok := logs.find("waits for restoration, whose start hook has not run")
	if !ok {
		t.Fatalf("nothing logged about the allocation waiting for restoration (start failed with %v)", err)
	}
	if after := r.Time.Sub(start); after > 2*time.Second {
		t.Errorf("logged %s after the start began, want about a second", after)
	}
	if !strings.Contains(caller, "TestEarlyAllocationLogged") {
		t.Errorf("the log names the caller %q, not the start hook", caller)
	}
	if !strings.Contains(r.Message, "depend on *restoration.Restorer") {
		t.Errorf("the log does not say the fix: %q", r.Message)
	}
}
