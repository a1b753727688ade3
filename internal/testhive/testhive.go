// Package testhive starts a hive for a test and stops it when the test
// ends: the one way this module's tests run a hive, so that each of them
// gives start and stop the same bound, logs to the test and fails on an
// error of either.
package testhive

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/hivetest"
)

// Timeout bounds a start and a stop: generous, because a loaded machine
// (the race detector, real etcd and API servers on two cores) is slow, and
// a hive that takes longer is stuck rather than slow.
const Timeout = time.Minute

// Running is a started hive.
type Running struct {
	tb   testing.TB
	h    *hive.Hive
	log  *slog.Logger
	once sync.Once
}

// Start starts h with the test's logger and fails tb if it does not start.
// The hive stops when the test ends, or earlier at Stop.
func Start(tb testing.TB, h *hive.Hive) *Running {
	tb.Helper()
	r, err := TryStart(tb, h, nil)
	if err != nil {
		tb.Fatalf("start: %v", err)
	}
	return r
}

// TryStart starts h and returns the start's error, for tests of a start
// that fails. log is where the hive logs; nil is the test's logger. A hive
// that started stops when the test ends, or earlier at Stop; one that did
// not start has nothing to stop.
func TryStart(tb testing.TB, h *hive.Hive, log *slog.Logger) (*Running, error) {
	tb.Helper()
	if log == nil {
		log = hivetest.Logger(tb)
	}
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	if err := h.Start(log, ctx); err != nil {
		return nil, err
	}
	r := &Running{tb: tb, h: h, log: log}
	tb.Cleanup(r.Stop)
	return r, nil
}

// Stop stops the hive and fails the test if the stop fails. Only the first
// call stops it; later ones, such as the one at the test's end, do nothing.
func (r *Running) Stop() {
	r.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), Timeout)
		defer cancel()
		if err := r.h.Stop(r.log, ctx); err != nil {
			r.tb.Errorf("stop: %v", err)
		}
	})
}
