package allocator

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/spf13/pflag"

	"github.com/identityd/identityd/identity"
)

// Config is the allocator's configuration.
type Config struct {
	// ClusterID is this cluster's ID in a cluster mesh (0..max-connected-clusters).
	ClusterID uint32
	// ClusterName is this cluster's name.
	ClusterName string
	// MaxConnectedClusters is the size of the cluster mesh: 255 or 511.
	MaxConnectedClusters uint32
	// IdentityAllocationTimeout bounds every allocator call that may wait
	// on the kvstore, and the shell commands that allocate and answer at
	// the durability point (identity/allocate, ipcache/upsert).
	IdentityAllocationTimeout time.Duration
	// EnableWellKnownIdentities gives the label sets of kube-dns, CoreDNS,
	// cilium-operator and Cilium's etcd their fixed identities 100..115
	// (Cilium's --enable-well-known-identities).
	EnableWellKnownIdentities bool
	// K8sNamespace is Cilium's namespace, in the well-known label sets of
	// Cilium's own components (Cilium's --k8s-namespace).
	K8sNamespace string
	// PolicyCIDRMatchMode lists what CIDR policies may select beyond
	// world: "nodes" gives remote nodes' label sets remote-node-scope
	// identities instead of the reserved 6 and 7 (Cilium's
	// --policy-cidr-match-mode).
	PolicyCIDRMatchMode []string
	// IdentityAllocationMode is the store of global identities: the etcd
	// of the kvstore cell, CiliumIdentity objects in a Kubernetes API
	// server, or both, one deciding (Cilium's --identity-allocation-mode).
	IdentityAllocationMode identity.AllocationMode
}

// PolicyCIDRMatchNodes is the --policy-cidr-match-mode value under which
// CIDR policies select nodes.
const PolicyCIDRMatchNodes = "nodes"

// DefaultConfig is the default configuration.
var DefaultConfig = Config{
	ClusterID:                 0,
	ClusterName:               identity.DefaultClusterName,
	MaxConnectedClusters:      identity.MaxConnectedClusters255,
	IdentityAllocationTimeout: 2 * time.Minute,
	// Off as in Cilium's Helm chart (wellKnownIdentities.enabled=false),
	// although the agent's own flag defaults to on.
	EnableWellKnownIdentities: false,
	K8sNamespace:              identity.DefaultCiliumNamespace,
	IdentityAllocationMode:    identity.AllocationModeKVStore,
}

// Flags registers the allocator's flags.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.Uint32("cluster-id", def.ClusterID, "Unique ID of this cluster in a cluster mesh (0 .. max-connected-clusters); selects its global identity range")
	flags.String("cluster-name", def.ClusterName, "Name of this cluster; must not be \"default\" when --cluster-id is non-zero")
	flags.Uint32("max-connected-clusters", def.MaxConnectedClusters, "Largest number of clusters in the mesh: 255 or 511 (changes the global identity ranges)")
	flags.Duration("identity-allocation-timeout", def.IdentityAllocationTimeout, "Bound on every identity allocation or release that waits for the store of global identities (etcd, or the Kubernetes API server in crd mode), or for restoration at start; identity/allocate and ipcache/upsert answer within it, their waits for the disk included")
	flags.Bool("enable-well-known-identities", def.EnableWellKnownIdentities, "Give kube-dns, CoreDNS, cilium-operator and Cilium's etcd their fixed identities 100..115, as Cilium's option of that name (Cilium's Helm chart turns it off)")
	flags.String("k8s-namespace", def.K8sNamespace, "Namespace Cilium runs in, as Cilium's option of that name; part of the well-known label sets of Cilium's components")
	flags.StringSlice("policy-cidr-match-mode", def.PolicyCIDRMatchMode, "What CIDR policies may select besides world, as Cilium's option of that name: \"nodes\" gives remote nodes' label sets remote-node-scope identities instead of the reserved 6 and 7")
	flags.String("identity-allocation-mode", string(def.IdentityAllocationMode), "Store of global identities, as Cilium's option of that name: \"kvstore\" (etcd, embedded unless --kvstore-endpoints is set), \"crd\" (CiliumIdentity objects in a Kubernetes API server), or, to move between them, \"doublewrite-readkvstore\" or \"doublewrite-readcrd\" (IDs decided in the named store and written to both)")
}

// ReservedConfig returns the options that decide which label sets are
// reserved or well-known.
func (c Config) ReservedConfig() identity.ReservedConfig {
	return identity.ReservedConfig{
		WellKnown:              c.EnableWellKnownIdentities,
		ClusterName:            c.ClusterName,
		CiliumNamespace:        c.K8sNamespace,
		PolicyCIDRMatchesNodes: slices.Contains(c.PolicyCIDRMatchMode, PolicyCIDRMatchNodes),
	}
}

// ClusterInfo returns the cluster part of the configuration.
func (c Config) ClusterInfo() identity.ClusterInfo {
	return identity.ClusterInfo{ID: c.ClusterID, Name: c.ClusterName, MaxConnectedClusters: c.MaxConnectedClusters}
}

// Validate checks the configuration.
func (c Config) Validate() error {
	if err := c.ClusterInfo().Validate(); err != nil {
		return fmt.Errorf("invalid cluster configuration: %w", err)
	}
	if c.IdentityAllocationTimeout <= 0 {
		return errors.New("--identity-allocation-timeout must be positive")
	}
	if err := c.IdentityAllocationMode.Validate(); err != nil {
		return err
	}
	for _, mode := range c.PolicyCIDRMatchMode {
		if mode != PolicyCIDRMatchNodes {
			return fmt.Errorf("invalid --policy-cidr-match-mode %q: the only mode is %q", mode, PolicyCIDRMatchNodes)
		}
	}
	return nil
}
