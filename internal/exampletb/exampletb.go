// Package exampletb gives Example functions, which get no *testing.T, a
// testing.TB for helpers that take one, such as the servers of package
// testenv: an Example that runs against a real etcd or API server is
// checked by go test like any other. testenv.Start uses it the same way
// for programs, turning a fatal error's panic into its error.
package exampletb

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
)

// TB is a testing.TB for an Example. A fatal error panics with its
// message, which go test reports as the Example's failure; Finish runs the
// cleanups, last registered first, and removes the temporary directories.
// Methods of testing.TB it does not implement panic.
type TB struct {
	testing.TB // nil: what TB does not implement

	name     string
	ctx      context.Context
	cancel   context.CancelFunc
	mu       sync.Mutex
	cleanups []func()
	failed   bool
	logs     []string
}

// New returns a TB named name.
func New(name string) *TB {
	ctx, cancel := context.WithCancel(context.Background())
	return &TB{name: name, ctx: ctx, cancel: cancel}
}

// Finish cancels the context and runs the cleanups. If the example
// failed, the log goes to standard error.
func (t *TB) Finish() {
	t.cancel()
	for {
		t.mu.Lock()
		n := len(t.cleanups)
		if n == 0 {
			t.mu.Unlock()
			break
		}
		f := t.cleanups[n-1]
		t.cleanups = t.cleanups[:n-1]
		t.mu.Unlock()
		f()
	}
	if t.Failed() {
		for _, l := range t.logs {
			fmt.Fprintln(os.Stderr, l)
		}
	}
}

// The methods of testing.TB that the servers' helpers call.

func (t *TB) Name() string                 { return t.name }
func (t *TB) Helper()                      {}
func (t *TB) Context() context.Context     { return t.ctx }
func (t *TB) Cleanup(f func())             { t.mu.Lock(); t.cleanups = append(t.cleanups, f); t.mu.Unlock() }
func (t *TB) Log(args ...any)              { t.log(fmt.Sprintln(args...)) }
func (t *TB) Logf(format string, a ...any) { t.log(fmt.Sprintf(format, a...)) }
func (t *TB) Error(args ...any)            { t.fail(); t.Log(args...) }
func (t *TB) Errorf(format string, a ...any) {
	t.fail()
	t.Logf(format, a...)
}
func (t *TB) Fail()    { t.fail() }
func (t *TB) FailNow() { t.fail(); panic(t.name + " failed") }
func (t *TB) Fatal(args ...any) {
	t.fail()
	panic(t.name + ": " + fmt.Sprint(args...))
}
func (t *TB) Fatalf(format string, a ...any) {
	t.fail()
	panic(t.name + ": " + fmt.Sprintf(format, a...))
}
func (t *TB) Failed() bool { t.mu.Lock(); defer t.mu.Unlock(); return t.failed }

// TempDir returns a new directory, removed by Finish.
func (t *TB) TempDir() string {
	dir, err := os.MkdirTemp("", "example")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func (t *TB) fail() { t.mu.Lock(); t.failed = true; t.mu.Unlock() }

func (t *TB) log(s string) { t.mu.Lock(); t.logs = append(t.logs, s); t.mu.Unlock() }
