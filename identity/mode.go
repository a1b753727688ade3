package identity

import (
	"fmt"
	"strings"
)

// AllocationMode names the store that holds this cluster's global
// identities, as Cilium's --identity-allocation-mode does.
type AllocationMode string

// The allocation modes, with Cilium's values.
const (
	// AllocationModeKVStore keeps global identities in etcd, with
	// Cilium's key layout.
	AllocationModeKVStore AllocationMode = "kvstore"
	// AllocationModeCRD keeps global identities in a Kubernetes API server
	// as CiliumIdentity objects.
	AllocationModeCRD AllocationMode = "crd"
)

// AllocationModes lists every valid AllocationMode, the default first.
var AllocationModes = []AllocationMode{AllocationModeKVStore, AllocationModeCRD}

// Validate reports an error that lists the valid values unless m is one of
// AllocationModes.
func (m AllocationMode) Validate() error {
	quoted := make([]string, len(AllocationModes))
	for i, valid := range AllocationModes {
		if m == valid {
			return nil
		}
		quoted[i] = fmt.Sprintf("%q", valid)
	}
	return fmt.Errorf("invalid --identity-allocation-mode %q: must be one of %s", string(m), strings.Join(quoted, ", "))
}

// NodeName is this node's name (--node-name), validated by the cell that
// owns the flag: the suffix of its etcd reference keys, and the name under
// which other stores record this node's uses. It is a type of its own so
// that a store takes it from the hive without importing the kvstore cell.
type NodeName string
