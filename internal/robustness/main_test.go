package robustness

import (
	"testing"

	"go.uber.org/goleak"
)

// The run starts clients, workers and process waiters; each must be gone
// when the test ends.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
