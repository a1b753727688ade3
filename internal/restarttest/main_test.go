package restarttest

import (
	"flag"
	"os"
	"testing"

	"github.com/identityd/identityd/internal/testproc"
)

// agent is the identityd binary the tests run by path, as an init system
// runs it, built once per test binary from this module's cmd/identityd.
var agent = testproc.OnceBuild{Build: testproc.BuildAgent}

// TestMain starts the build of the identityd binary at once, so that it
// links while the first test prepares, and removes it at the end.
func TestMain(m *testing.M) {
	flag.Parse()
	if !testing.Short() {
		agent.Start()
	}
	code := m.Run()
	agent.Remove()
	os.Exit(code)
}

// agentBinary returns the path of the identityd binary.
func agentBinary(t *testing.T) string {
	t.Helper()
	return agent.Path(t)
}
