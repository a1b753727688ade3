// Command prebuild builds the servers that package testenv runs (a
// one-member etcd and a Kubernetes API server) into the user's cache,
// where testenv finds them, with no deadline. Run it once on a fresh
// machine before the tests of a module that uses testenv:
//
//	go run github.com/identityd/identityd/testenv/prebuild
//
// A first build of the API server compiles the Kubernetes API server
// libraries and takes minutes; a test that has to build it itself stops
// the build before go test's -timeout and says to run this instead.
package main

import (
	"fmt"
	"os"
	"time"

	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/k8stest"
)

func main() {
	for _, server := range []struct {
		name  string
		build func(time.Time) (string, error)
	}{{"etcd", etcdtest.Binary}, {"apiserver", k8stest.Binary}} {
		path, err := server.build(time.Time{})
		if err != nil {
			fmt.Fprintln(os.Stderr, "prebuild:", err)
			os.Exit(1)
		}
		fmt.Printf("%s\t%s\n", server.name, path)
	}
}
