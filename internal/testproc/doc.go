// Package testproc holds what the packages that run servers as processes
// for tests share: commands of this module built once and cached, free
// loopback ports, the kernel's guarantee that a server dies with the test
// binary, and reading the servers' logs.
package testproc
