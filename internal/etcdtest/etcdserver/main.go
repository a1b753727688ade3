// Command etcdserver is the etcd server of the module's etcd version, built
// by package etcdtest so that integration tests run the same server code the
// agent embeds, as separate processes they can kill, pause and restart.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
