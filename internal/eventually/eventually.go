// Package eventually waits, in tests, for a condition that other goroutines
// or processes make true: the one way this module's tests wait, instead of
// sleeping for a guessed time.
package eventually

import (
	"testing"
	"time"
)

// DefaultTimeout bounds True: generous, because a loaded machine (the race
// detector, two cores shared by several test binaries) slows everything.
const DefaultTimeout = 20 * time.Second

// pollInterval is how often the condition is checked.
const pollInterval = 2 * time.Millisecond

// True polls cond until it holds, and fails tb if it does not within
// DefaultTimeout. what names the condition in the failure.
func True(tb testing.TB, what string, cond func() bool) {
	tb.Helper()
	Within(tb, DefaultTimeout, what, cond)
}

// Within is True with the bound d.
func Within(tb testing.TB, d time.Duration, what string, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(pollInterval)
	}
}
