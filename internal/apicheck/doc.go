// Package apicheck holds the test that keeps identityd's public API
// nameable by other modules: no exported function, method, field, variable
// or type of the public packages (cells/..., labels, identity) may name a
// type of an internal/ package, which an importer outside the module
// cannot write down.
package apicheck
