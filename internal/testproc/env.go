package testproc

import (
	"os"
	"strconv"
	"testing"
)

// CountFromEnv returns the whole number in the environment variable name,
// or def when it is unset, and fails tb when the value is not a number of
// at least min. Tests that `make test` runs at a smaller size than
// `make test-long` read their size with it.
func CountFromEnv(tb testing.TB, name string, def, min int) int {
	tb.Helper()
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < min {
		tb.Fatalf("%s=%q: want a whole number of at least %d", name, s, min)
	}
	return n
}
