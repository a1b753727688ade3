package restarttest

import (
	"flag"
	"testing"

	"go.uber.org/goleak"

	"github.com/identityd/identityd/internal/testproc"
)

// agent is the identityd binary the tests run by path, as an init system
// runs it, built once per test binary from this module's cmd/identityd.
var agent = testproc.OnceBuild{Build: testproc.BuildAgent}

// TestMain starts the build of the identityd binary at once, so that it
// links while the first test prepares, and removes it at the end, before
// goleak looks for goroutines the tests left.
func TestMain(m *testing.M) {
	flag.Parse()
	if !testing.Short() {
		agent.Start()
	}
	goleak.VerifyTestMain(removeAgentAfter{m})
}

// removeAgentAfter runs the tests and then waits for the build of the
// binary and removes it.
type removeAgentAfter struct{ m *testing.M }

func (r removeAgentAfter) Run() int {
	code := r.m.Run()
	agent.Remove()
	return code
}

// agentBinary returns the path of the identityd binary.
func agentBinary(t *testing.T) string {
	t.Helper()
	return agent.Path(t)
}
