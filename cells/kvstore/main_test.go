package kvstore_test

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	// Re-executed as another user by TestEmbeddedEtcdRefusesOtherUsers.
	if os.Getenv(foreignEndpointsEnv) != "" {
		os.Exit(foreignClient())
	}
	goleak.VerifyTestMain(m)
}
