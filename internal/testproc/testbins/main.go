// Command testbins builds the binaries that the tests run as processes
// (the test etcd server, the test API server and the identityd agent) as
// internal/testproc builds them on first use, in the image's mode.
//
// `make test` runs it before `go test`: on a fresh machine, compiling them
// while go test compiled and ran the race-built tests took more CPU in all,
// and the first tests waited for them behind the build lock.
//
// With -vet it vets the two servers instead, in the mode they are built
// in, so that vet finds their dependencies compiled (`make vet-servers`);
// the API server in its own module (internal/k8stest/kubeapiserver).
package main

import (
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/k8stest"
	"github.com/identityd/identityd/internal/testproc"
)

func main() {
	vet := flag.Bool("vet", false, "vet the test servers instead of building the binaries")
	flag.Parse()
	run := buildAll
	if *vet {
		run = vetServers
	}
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "testbins:", err)
		os.Exit(1)
	}
}

// vetServers runs go vet over the two servers' main packages in the mode
// they are built with: the API server's in its own module.
func vetServers() error {
	apiServer, err := testproc.ModuleSource(k8stest.ServerModule)
	if err != nil {
		return err
	}
	for _, v := range []struct{ dir, pkg string }{{".", "./" + etcdtest.ServerPackage}, {apiServer, "."}} {
		cmd := testproc.InImageMode("vet", v.pkg)
		cmd.Dir = v.dir
		cmd.Env = append(cmd.Env, "GOWORK=off")
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("go vet %s in %s: %w", v.pkg, v.dir, err)
		}
	}
	return nil
}

func buildAll() error {
	if _, err := etcdtest.Binary(time.Time{}); err != nil {
		return err
	}
	if _, err := k8stest.Binary(time.Time{}); err != nil {
		return err
	}
	// The agent is built per test binary, from the sources of the moment
	// (testproc.BuildAgent): this build links the checkout's shared
	// binary, which those builds then find up to date and copy.
	dir, err := os.MkdirTemp("", "testbins")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	_, err = testproc.BuildAgent(dir)
	return err
}
