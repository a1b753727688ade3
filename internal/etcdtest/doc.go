// Package etcdtest runs real etcd servers as separate processes for
// integration tests: single members and multi-member clusters on free
// 127.0.0.1 ports, with data in the test's temporary directory, optional TLS
// with client certificates and optional authentication.
//
// The server binary is built once from this module's go.etcd.io/etcd/server/v3
// version (see Binary) and cached under the user cache directory, so the
// servers under test are the same code the agent embeds. Members can be
// killed (SIGKILL), paused (SIGSTOP), resumed and restarted on the same data
// directory and ports, to test what clients do when etcd misbehaves.
//
// Every process is killed when the test ends; the servers' logs are printed
// through the test's log only when the test failed.
//
//	c := etcdtest.StartCluster(t, 3)
//	cli := c.Client(t)
//	c.Member(0).Kill()
package etcdtest
