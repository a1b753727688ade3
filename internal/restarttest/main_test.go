package restarttest

import (
	"flag"
	"os"
	"sync"
	"testing"

	"github.com/identityd/identityd/internal/testproc"
)

// TestMain starts the build of the identityd binary at once, so that it
// links while the first test prepares, and removes it at the end.
func TestMain(m *testing.M) {
	flag.Parse()
	if !testing.Short() {
		go built.once.Do(buildAgent)
	}
	code := m.Run()
	built.once.Do(func() {}) // a build still running is waited for
	if built.dir != "" {
		os.RemoveAll(built.dir)
	}
	os.Exit(code)
}

// built is the identityd binary the tests run by path, as an init system
// runs it.
var built struct {
	once sync.Once
	dir  string
	bin  string
	err  error
}

// agentBinary returns the path of the identityd binary, built once per test
// binary from this module's cmd/identityd.
func agentBinary(t *testing.T) string {
	t.Helper()
	built.once.Do(buildAgent)
	if built.err != nil {
		t.Fatal(built.err)
	}
	return built.bin
}

func buildAgent() {
	if built.dir, built.err = os.MkdirTemp("", "identityd-restarttest"); built.err != nil {
		return
	}
	built.bin, built.err = testproc.BuildAgent(built.dir)
}
