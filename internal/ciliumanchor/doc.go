// Package ciliumanchor measures Cilium v1.16.2's own local identity
// allocator with the harness of identityd's allocator benchmarks
// (cells/allocator/bench_test.go): the same label sets, counts and metrics.
//
// DESIGN.md states identityd's local-allocation targets as multiples of
// what Cilium's code measures on the build machine. That machine's speed
// moves by a fifth and more within an hour, which moves a multiple of a
// fixed figure with it. `make bench-anchor` runs both benchmarks in
// alternating processes (the compare command) and reports the multiple of
// each round, which the machine's drift moves far less.
//
// It is a module of its own, so that Cilium and its dependencies are
// downloaded and built only by `make bench-anchor`, never by `make test`.
// It cannot share a process with identityd: Cilium v1.16.2 needs older
// versions of statedb and hive than identityd does.
package ciliumanchor
