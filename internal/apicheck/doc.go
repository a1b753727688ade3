// Package apicheck holds the tests that keep identityd's public API
// nameable by other modules: no exported function, method, field, variable
// or type of the public packages (cells/..., labels, identity, testenv) may name a
// type of an internal/ package, which an importer outside the module
// cannot write down; and the compose example (docs/examples/compose, a
// module of its own) calls every method of the cells it composes that
// returns a value, so that building it shows each of those types can be
// named from outside.
package apicheck
