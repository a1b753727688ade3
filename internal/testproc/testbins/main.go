// Command testbins builds the binaries that the tests run as processes
// (the test etcd server, the test API server and the identityd agent) as
// internal/testproc builds them on first use, in the image's mode.
//
// `make test` runs it before `go test`: on a fresh machine, compiling them
// while go test compiled and ran the race-built tests took more CPU in all,
// and the first tests waited for them behind the build lock.
//
// With -vet it vets the two servers instead, with the flags they are built
// with, so that vet finds their dependencies compiled (`make vet-servers`).
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
// and with the flags they are built with. The flags of the API server
// name none of the etcd server's packages, so one go vet serves both.
func vetServers() error {
	args := append(append([]string{}, k8stest.ServerBuildFlags...), "./"+k8stest.ServerPackage, "./"+etcdtest.ServerPackage)
	cmd := testproc.InImageMode("vet", args...)
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	return cmd.Run()
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
