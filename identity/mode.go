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
	// AllocationModeDoubleWriteReadKVStore decides global identities in
	// etcd, as kvstore mode, and writes each one this node uses to the
	// Kubernetes API server too, with the same ID: the first step of a
	// move from etcd to CRDs (Cilium v1.17's mode of that name).
	AllocationModeDoubleWriteReadKVStore AllocationMode = "doublewrite-readkvstore"
	// AllocationModeDoubleWriteReadCRD decides global identities in the
	// Kubernetes API server, as crd mode, and writes each one this node
	// uses to etcd too, with the same ID.
	AllocationModeDoubleWriteReadCRD AllocationMode = "doublewrite-readcrd"
)

// AllocationModes lists every valid AllocationMode, the default first.
var AllocationModes = []AllocationMode{AllocationModeKVStore, AllocationModeCRD,
	AllocationModeDoubleWriteReadKVStore, AllocationModeDoubleWriteReadCRD}

// DoubleWrite reports whether m writes global identities to both stores.
func (m AllocationMode) DoubleWrite() bool {
	return m == AllocationModeDoubleWriteReadKVStore || m == AllocationModeDoubleWriteReadCRD
}

// ReadStore returns the pure mode of the store that decides global
// identities in m: m itself outside the double-write modes.
func (m AllocationMode) ReadStore() AllocationMode {
	switch m {
	case AllocationModeDoubleWriteReadKVStore:
		return AllocationModeKVStore
	case AllocationModeDoubleWriteReadCRD:
		return AllocationModeCRD
	}
	return m
}

// WriteOnlyStore returns the pure mode of the store that m writes without
// reading it, or "" outside the double-write modes.
func (m AllocationMode) WriteOnlyStore() AllocationMode {
	switch m {
	case AllocationModeDoubleWriteReadKVStore:
		return AllocationModeCRD
	case AllocationModeDoubleWriteReadCRD:
		return AllocationModeKVStore
	}
	return ""
}

// UsesKVStore reports whether m keeps global identities in etcd: kvstore
// mode (also the zero value, a hive without mode selection) and both
// double-write modes.
func (m AllocationMode) UsesKVStore() bool { return m != AllocationModeCRD }

// UsesCRD reports whether m keeps global identities in a Kubernetes API
// server: crd mode and both double-write modes.
func (m AllocationMode) UsesCRD() bool { return m == AllocationModeCRD || m.DoubleWrite() }

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
