// Package restarttest holds the process tests of what identityd keeps
// across a stop: the binary, built once per test binary, runs as a process
// on a state directory of its own, fills its ipcache and allocates through
// its shell, and is stopped with SIGTERM or SIGKILL, at times right after
// an answer, and started again on the same directory. The tests check that
// every answer given as durable is there after the restart, in the
// ipcache table and in the datapath map (a file or a pinned BPF map), with
// the same numbers, and that damaged journals are kept aside rather than
// replayed.
//
// They live apart from cmd/identityd's own tests so that go test runs them
// as a test binary of their own, beside that package's, rather than after
// it. TestKillDuringDurableAnswers' number of kills per backend is set by
// IDENTITYD_KILL_ROUNDS (`make robustness` runs more than `make test`).
package restarttest
