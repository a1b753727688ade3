package identity

import (
	"slices"

	"github.com/identityd/identityd/labels"
)

// Well-known identities: fixed numbers Cilium gives the label sets of a few
// cluster components when --enable-well-known-identities is on, so that
// their policy works before the kvstore is reachable. Each component has two
// numbers: the second is for its set with the namespace-name label that
// Kubernetes 1.21 and later put on every namespace.
const (
	WellKnownETCDOperator        NumericIdentity = 100
	WellKnownCiliumKVStore       NumericIdentity = 101
	WellKnownKubeDNS             NumericIdentity = 102
	WellKnownEKSKubeDNS          NumericIdentity = 103
	WellKnownCoreDNS             NumericIdentity = 104
	WellKnownCiliumOperator      NumericIdentity = 105
	WellKnownEKSCoreDNS          NumericIdentity = 106
	WellKnownCiliumEtcdOperator  NumericIdentity = 107
	WellKnownETCDOperator2       NumericIdentity = 108
	WellKnownCiliumKVStore2      NumericIdentity = 109
	WellKnownKubeDNS2            NumericIdentity = 110
	WellKnownEKSKubeDNS2         NumericIdentity = 111
	WellKnownCoreDNS2            NumericIdentity = 112
	WellKnownCiliumOperator2     NumericIdentity = 113
	WellKnownEKSCoreDNS2         NumericIdentity = 114
	WellKnownCiliumEtcdOperator2 NumericIdentity = 115
)

// Label keys of the well-known label sets (Kubernetes labels as Cilium
// records them).
const (
	PodNamespaceLabelKey   = "io.kubernetes.pod.namespace"
	NamespaceNameLabelKey  = "io.cilium.k8s.namespace.labels.kubernetes.io/metadata.name"
	ServiceAccountLabelKey = "io.cilium.k8s.policy.serviceaccount"
	FixedIdentityLabelKey  = "io.cilium.fixed-identity"
)

// DefaultCiliumNamespace is the namespace Cilium's Helm chart installs into
// by default; the agent learns its namespace from --k8s-namespace
// (CILIUM_K8S_NAMESPACE), which the chart sets to the pod's namespace.
const DefaultCiliumNamespace = "kube-system"

const (
	// The DNS well-known sets name kube-system whatever Cilium's namespace.
	kubeDNSNamespace           = "kube-system"
	secondWellKnownIdentityGap = WellKnownETCDOperator2 - WellKnownETCDOperator
)

// WellKnownIdentities returns the 16 well-known identities of a cluster, in
// ID order: the label sets carry the cluster's name in the cluster label,
// and Cilium's own components (etcd-operator, its etcd, cilium-operator)
// carry ciliumNamespace, while the DNS sets always name kube-system.
func WellKnownIdentities(clusterName, ciliumNamespace string) []*Identity {
	k8s := func(key, value string) labels.Label {
		return labels.Label{Source: labels.SourceK8s, Key: key, Value: value}
	}
	// Each component's own labels, then the namespace its pods run in.
	components := []struct {
		id        NumericIdentity
		namespace string
		account   string
		own       []labels.Label
	}{
		{WellKnownETCDOperator, ciliumNamespace, "cilium-etcd-sa", []labels.Label{
			k8s("io.cilium/app", "etcd-operator"),
		}},
		{WellKnownCiliumKVStore, ciliumNamespace, "default", []labels.Label{
			k8s("app", "etcd"),
			k8s("etcd_cluster", "cilium-etcd"),
			k8s("io.cilium/app", "etcd-operator"),
		}},
		{WellKnownKubeDNS, kubeDNSNamespace, "kube-dns", []labels.Label{
			k8s("k8s-app", "kube-dns"),
		}},
		{WellKnownEKSKubeDNS, kubeDNSNamespace, "kube-dns", []labels.Label{
			k8s("k8s-app", "kube-dns"),
			k8s("eks.amazonaws.com/component", "kube-dns"),
		}},
		{WellKnownCoreDNS, kubeDNSNamespace, "coredns", []labels.Label{
			k8s("k8s-app", "kube-dns"),
		}},
		{WellKnownCiliumOperator, ciliumNamespace, "cilium-operator", []labels.Label{
			k8s("name", "cilium-operator"),
			k8s("io.cilium/app", "operator"),
			k8s("app.kubernetes.io/part-of", "cilium"),
			k8s("app.kubernetes.io/name", "cilium-operator"),
		}},
		{WellKnownEKSCoreDNS, kubeDNSNamespace, "coredns", []labels.Label{
			k8s("k8s-app", "kube-dns"),
			k8s("eks.amazonaws.com/component", "coredns"),
		}},
		// Cilium writes these two labels with ": " instead of "=", so the
		// key is the whole text and the value is empty; no pod carries
		// such a label, but the numbers must stand for the same sets.
		{WellKnownCiliumEtcdOperator, ciliumNamespace, "cilium-etcd-operator", []labels.Label{
			k8s("name", "cilium-etcd-operator"),
			k8s("io.cilium/app", "etcd-operator"),
			k8s("app.kubernetes.io/name: cilium-etcd-operator", ""),
			k8s("app.kubernetes.io/part-of: cilium", ""),
		}},
	}
	out := make([]*Identity, 2*len(components))
	for i, c := range components {
		first := append(slices.Clone(c.own),
			k8s(PodNamespaceLabelKey, c.namespace),
			k8s(ServiceAccountLabelKey, c.account),
			k8s(ClusterLabelKey, clusterName))
		second := append(slices.Clone(first), k8s(NamespaceNameLabelKey, c.namespace))
		out[i] = &Identity{ID: c.id, Labels: labels.MustNew(first...)}
		out[i+len(components)] = &Identity{ID: c.id + secondWellKnownIdentityGap, Labels: labels.MustNew(second...)}
	}
	return out
}

// ReservedConfig holds the Cilium options that change which label sets
// resolve to reserved or well-known identities.
type ReservedConfig struct {
	// WellKnown is --enable-well-known-identities.
	WellKnown bool
	// ClusterName goes into the well-known sets' cluster label.
	ClusterName string
	// CiliumNamespace is Cilium's namespace (--k8s-namespace), in the
	// well-known sets of Cilium's own components.
	CiliumNamespace string
	// PolicyCIDRMatchesNodes is --policy-cidr-match-mode=nodes: label sets
	// with reserved:remote-node then get remote-node-scope identities
	// instead of the reserved remote-node (6) or kube-apiserver (7).
	PolicyCIDRMatchesNodes bool
}

// ReservedResolver resolves label sets and numbers to reserved and
// well-known identities under one ReservedConfig. It is immutable and safe
// for concurrent use.
type ReservedResolver struct {
	cfg       ReservedConfig
	wellKnown []*Identity // in ID order; empty when disabled
	all       []*Identity // reserved then well-known, in ID order
}

// NewReservedResolver returns the resolver for cfg.
func NewReservedResolver(cfg ReservedConfig) *ReservedResolver {
	r := &ReservedResolver{cfg: cfg, all: ReservedIdentities()}
	if cfg.WellKnown {
		r.wellKnown = WellKnownIdentities(cfg.ClusterName, cfg.CiliumNamespace)
		r.all = append(r.all, r.wellKnown...)
	}
	return r
}

// Config returns the resolver's configuration.
func (r *ReservedResolver) Config() ReservedConfig { return r.cfg }

// Identities returns the reserved identities, then the well-known ones if
// enabled, in ID order. They are shared and must not be modified.
func (r *ReservedResolver) Identities() []*Identity { return slices.Clone(r.all) }

// LookupByID returns the reserved or (if enabled) well-known identity with
// this number, or nil.
func (r *ReservedResolver) LookupByID(id NumericIdentity) *Identity {
	if res := LookupReservedByID(id); res != nil {
		return res
	}
	if i := int(id) - int(WellKnownETCDOperator); i >= 0 && i < len(r.wellKnown) {
		return r.wellKnown[i]
	}
	return nil
}

// IsWellKnown reports whether id is an enabled well-known identity.
func (r *ReservedResolver) IsWellKnown(id NumericIdentity) bool {
	i := int(id) - int(WellKnownETCDOperator)
	return i >= 0 && i < len(r.wellKnown)
}

// LookupByLabels returns the identity a label set resolves to without
// allocation, or nil, by Cilium's rules:
//
//   - a set equal to an enabled well-known set is that identity;
//   - a set with a label keyed io.cilium.fixed-identity is never reserved
//     (it would name an operator-defined identity, which identityd has not);
//   - a set without a reserved label is not reserved;
//   - a set with reserved:host is the host (1), and one with
//     reserved:remote-node, unless PolicyCIDRMatchesNodes, is the
//     kube-apiserver (7) if it also has reserved:kube-apiserver and the
//     remote node (6) otherwise; both keep the caller's whole label set;
//   - otherwise only a single reserved label naming a reserved identity
//     resolves, to that identity as it is defined (reserved:kube-apiserver
//     alone is 7 with its two labels), so that a workload cannot claim a
//     reserved identity by adding a reserved label to its own.
func (r *ReservedResolver) LookupByLabels(ls labels.Labels) *Identity {
	for _, w := range r.wellKnown {
		if ls.Equal(w.Labels) {
			return w
		}
	}
	if _, ok := ls.Get(FixedIdentityLabelKey); ok {
		return nil
	}
	hasReserved := false
	for _, l := range ls {
		if l.Source == labels.SourceReserved {
			hasReserved = true
			break
		}
	}
	if !hasReserved {
		return nil
	}
	var id NumericIdentity
	switch {
	case ls.Has(labels.LabelHost):
		id = ReservedIdentityHost
	case ls.Has(labels.LabelRemoteNode):
		if r.cfg.PolicyCIDRMatchesNodes {
			return nil
		}
		id = ReservedIdentityRemoteNode
		if ls.Has(labels.Reserved(labels.IDNameKubeAPIServer)) {
			id = ReservedIdentityKubeAPIServer
		}
	}
	if id != InvalidIdentity {
		if res := reserved[id].identity; ls.Equal(res.Labels) {
			return res
		}
		return &Identity{ID: id, Labels: ls}
	}
	if len(ls) != 1 {
		return nil
	}
	return LookupReservedByName(ls[0].Key)
}
