package crdstore

import (
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/spf13/pflag"
)

// MinIdentityNodeLeaseTTL is the shortest --identity-node-lease-ttl: the
// record is renewed every third of it, and a renewal must have room for a
// slow API server's answer.
const MinIdentityNodeLeaseTTL = 25 * time.Second

// CiliumAgentSyncPeriod is the default period of a Cilium agent's sync of
// the identities it uses. Besides an allocation, that sync is the only
// time a Cilium v1.16 agent removes the heartbeat mark of an identity it
// uses.
const CiliumAgentSyncPeriod = 5 * time.Minute

// MinHeartbeatTimeoutBesideCilium is the shortest --identity-heartbeat-timeout
// while Cilium agents may use the cluster's identities: a mark set just
// after an agent's sync stays until its next one, a period later, and the
// second period covers a sync that runs late (a busy agent walks its keys
// one request at a time, its informer shows the mark with a delay, an
// agent restarting in between syncs only once it runs again). An identity
// a Cilium endpoint uses is kept by its CiliumEndpoint whatever the
// timeout; the timeout protects what no endpoint object names yet.
const MinHeartbeatTimeoutBesideCilium = 2 * CiliumAgentSyncPeriod

// Config configures the CRD store of global identities.
type Config struct {
	// IdentityNodeLeaseTTL is how long this node's IdentityNode record
	// counts after its last renewal; it is renewed every third of it. A
	// node that stops renewing (killed, cut off) stops protecting its
	// identities once it ends.
	IdentityNodeLeaseTTL time.Duration
	// IdentityGCCiliumAgents states that Cilium agents may use the
	// cluster's CiliumIdentity objects: the garbage collection's heartbeat
	// timeout must then be at least MinHeartbeatTimeoutBesideCilium.
	// False, where only identityd nodes allocate, lowers the bound to
	// MinHeartbeatTimeout, and the collector then deletes an identity no
	// IdentityNode lists after a grace of half its interval (at least
	// MinHeartbeatTimeout) rather than after the timeout.
	IdentityGCCiliumAgents bool
	// IdentityGCLeaseNamespace is the namespace of the Lease that elects
	// the collector; "" for the namespace of the agent's pod (its service
	// account's namespace file), or kube-system outside a pod.
	IdentityGCLeaseNamespace string
}

// DefaultConfig is the default configuration of the CRD store.
var DefaultConfig = Config{
	IdentityNodeLeaseTTL:   15 * time.Minute,
	IdentityGCCiliumAgents: true,
}

// Flags registers the flags of the CRD store.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.Duration("identity-node-lease-ttl", def.IdentityNodeLeaseTTL,
		"How long this node's IdentityNode record of the global identities it uses counts after its last renewal (renewed every third of it; at least 25s)")
	flags.Bool("identity-gc-cilium-agents", def.IdentityGCCiliumAgents,
		"Whether Cilium agents may use this cluster's CiliumIdentity objects (crd mode): --identity-heartbeat-timeout must then be at least 10m, as a Cilium agent removes the heartbeat mark of an identity it uses only when it allocates it or at its periodic sync (every 5m); false, only where no Cilium agent allocates, allows 2m and deletes a released identity half an --identity-gc-interval after its mark (at least 2m), whatever the timeout")
	flags.String("identity-gc-lease-namespace", def.IdentityGCLeaseNamespace,
		"The namespace of the coordination.k8s.io Lease identity-gc-<cluster ID> that elects the node collecting unused identities (crd mode; `kubectl get lease -n <namespace>` names it); empty for the namespace of the agent's pod, or kube-system outside a pod")
}

// serviceAccountNamespaceFile holds the namespace of the pod whose
// service account token is mounted, in every pod that has one.
var serviceAccountNamespaceFile = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

// leaseNamespace is the namespace of the collector's Lease.
func (c Config) leaseNamespace() string {
	if c.IdentityGCLeaseNamespace != "" {
		return c.IdentityGCLeaseNamespace
	}
	if b, err := os.ReadFile(serviceAccountNamespaceFile); err == nil {
		if ns := strings.TrimSpace(string(b)); ns != "" {
			return ns
		}
	}
	return "kube-system"
}

// Validate checks the configuration.
func (c Config) Validate() error {
	if c.IdentityNodeLeaseTTL < MinIdentityNodeLeaseTTL {
		return fmt.Errorf("--identity-node-lease-ttl must be at least %s, not %s", MinIdentityNodeLeaseTTL, c.IdentityNodeLeaseTTL)
	}
	return nil
}

// validateHeartbeat checks the garbage collection's heartbeat timeout
// against what the Cilium agents of the cluster need.
func (c Config) validateHeartbeat(timeout time.Duration) error {
	if c.IdentityGCCiliumAgents && timeout < MinHeartbeatTimeoutBesideCilium {
		return fmt.Errorf("--identity-heartbeat-timeout must be at least %s beside Cilium agents, not %s: "+
			"a Cilium agent removes the heartbeat mark of an identity it uses only when it allocates it or at its periodic sync (every %s by default), "+
			"so a shorter timeout deletes identities that live Cilium agents use; "+
			"only where no Cilium agent allocates identities, --identity-gc-cilium-agents=false allows %s",
			MinHeartbeatTimeoutBesideCilium, timeout, CiliumAgentSyncPeriod, MinHeartbeatTimeout)
	}
	return nil
}
