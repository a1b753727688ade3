// Package robustness checks identityd under faults: a 3-member etcd
// cluster and 3 identityd agents run as real processes while a random
// workload of global and local allocations and releases goes through the
// agents' shells, and etcd members and agents are killed, paused and
// restarted. Every operation is recorded in a History; afterwards a Checker
// verifies that no numeric ID stood for two label sets at once, that all
// nodes agreed on global IDs, that local IDs survived agent restarts, that
// no operation succeeded after its deadline, and (CheckFinal) that the
// references the agents hold match the reference keys in etcd.
//
// The run itself is TestRobustness; its length is set by the
// ROBUSTNESS_DURATION environment variable (`make robustness`), with a
// short run by default that `go test -short` skips.
package robustness
