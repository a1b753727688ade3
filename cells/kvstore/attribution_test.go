package kvstore_test

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/job"
	"github.com/spf13/pflag"

	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/cells/statedir"
)

// records keeps every log record as a line of text, with the attributes
// of its logger.
type records struct {
	sink  *sink
	attrs []slog.Attr
}

type sink struct {
	mu    sync.Mutex
	lines []string
}

func (r records) Enabled(context.Context, slog.Level) bool { return true }

func (r records) Handle(_ context.Context, rec slog.Record) error {
	var b strings.Builder
	b.WriteString(rec.Level.String() + " " + rec.Message)
	for _, a := range r.attrs {
		b.WriteString(" " + a.String())
	}
	rec.Attrs(func(a slog.Attr) bool {
		b.WriteString(" " + a.String())
		return true
	})
	r.sink.mu.Lock()
	r.sink.lines = append(r.sink.lines, b.String())
	r.sink.mu.Unlock()
	return nil
}

func (r records) WithAttrs(attrs []slog.Attr) slog.Handler {
	return records{sink: r.sink, attrs: append(append([]slog.Attr(nil), r.attrs...), attrs...)}
}

func (r records) WithGroup(string) slog.Handler { return r }

// TestConfigErrorNamesKVStore: a hive that lists the metrics cell before
// this one (as the agent does) and is given an invalid --node-name fails
// in this module's invoke, and hive's log line names it, not the metrics
// registry's invoke that first needs the client.
func TestConfigErrorNamesKVStore(t *testing.T) {
	for _, name := range []string{"a/b", "a b", "-a"} {
		rec := records{sink: &sink{}}
		h := hive.New(health.Cell, metrics.Cell, job.Cell, statedir.Cell, kvstore.Cell)
		flags := pflag.NewFlagSet("test", pflag.ContinueOnError)
		h.RegisterFlags(flags)
		if err := flags.Parse([]string{"--state-dir", t.TempDir(), "--node-name", name}); err != nil {
			t.Fatal(err)
		}
		err := h.Populate(slog.New(rec))
		if err == nil || !strings.Contains(err.Error(), "--node-name") {
			t.Fatalf("--node-name %q: %v", name, err)
		}
		var failed []string
		for _, l := range rec.sink.lines {
			if strings.Contains(l, "Invoke failed") {
				failed = append(failed, l)
			}
		}
		if len(failed) != 1 || !strings.Contains(failed[0], "function=kvstore.") || strings.Contains(failed[0], "metrics") {
			t.Errorf("--node-name %q: the failed invoke is not kvstore's: %q", name, failed)
		}
	}
}
