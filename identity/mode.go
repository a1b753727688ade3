package identity

// AllocationMode is where global identities are stored: etcd (kvstore) or
// CiliumIdentity objects in a Kubernetes API server (crd), as Cilium's
// identity-allocation-mode.
type AllocationMode string

const (
	AllocationModeKVStore AllocationMode = "kvstore"
	AllocationModeCRD     AllocationMode = "crd"
)
