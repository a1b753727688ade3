package identity

// AllocationMode names the store of global identities
// (--identity-allocation-mode, with Cilium's values).
type AllocationMode string

// The allocation modes.
const (
	AllocationModeKVStore AllocationMode = "kvstore"
	AllocationModeCRD     AllocationMode = "crd"
)

// NodeName is this node's name (--node-name), under which the global
// stores record the identities it uses.
type NodeName string
