// Package modemigration holds the process test of moving a running cluster
// between the two stores of global identities without renumbering: three
// identityd processes on a real etcd and a real Kubernetes API server,
// holding global identities as users do, are restarted one at a time
// through every --identity-allocation-mode from kvstore to crd and back
// (kvstore, doublewrite-readkvstore, doublewrite-readcrd, crd, then the
// same in reverse), one restart of each step with SIGKILL. After every
// restart each node must answer every label set with the ID it had before
// the first step, the nodes must agree, the restarted node must get its
// label sets back with their IDs, and at the end of each double-write step
// the convergence report must show no difference between the stores.
//
// The package has no code of its own: it is a package of its own so that
// its test, which runs for a minute or two, runs beside the long test
// binary of cmd/identityd instead of after it.
package modemigration
