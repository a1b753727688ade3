package identity

import (
	"errors"
	"strings"
	"testing"

	"github.com/identityd/identityd/labels"
)

func TestReservedIdentities(t *testing.T) {
	want := []struct {
		id     NumericIdentity
		name   string
		labels string
	}{
		{1, "host", "reserved:host=;"},
		{2, "world", "reserved:world=;"},
		{3, "unmanaged", "reserved:unmanaged=;"},
		{4, "health", "reserved:health=;"},
		{5, "init", "reserved:init=;"},
		{6, "remote-node", "reserved:remote-node=;"},
		{7, "kube-apiserver", "reserved:kube-apiserver=;reserved:remote-node=;"},
		{8, "ingress", "reserved:ingress=;"},
		{9, "world-ipv4", "reserved:world-ipv4=;"},
		{10, "world-ipv6", "reserved:world-ipv6=;"},
	}
	got := ReservedIdentities()
	if len(got) != len(want) {
		t.Fatalf("%d reserved identities, want %d", len(got), len(want))
	}
	for i, w := range want {
		if got[i].ID != w.id || got[i].Labels.Canonical() != w.labels {
			t.Errorf("reserved %d = %s, want %d %s", i, got[i], w.id, w.labels)
		}
		if name, ok := ReservedName(w.id); !ok || name != w.name {
			t.Errorf("ReservedName(%d) = %q", w.id, name)
		}
		if LookupReservedByID(w.id) != got[i] || LookupReservedByName(w.name) != got[i] {
			t.Errorf("lookup of %d", w.id)
		}
		if r := withoutNodes.LookupByLabels(got[i].Labels); r == nil || r.ID != w.id {
			t.Errorf("LookupByLabels(%s) = %v, want %d", got[i].Labels, r, w.id)
		}
	}
	if LookupReservedByID(0) != nil || LookupReservedByID(11) != nil || LookupReservedByID(200) != nil {
		t.Error("non-reserved IDs resolved")
	}
}

var (
	withoutNodes = NewReservedResolver(ReservedConfig{})
	withNodes    = NewReservedResolver(ReservedConfig{PolicyCIDRMatchesNodes: true})
)

// TestLookupReservedRules checks Cilium v1.16's LookupReservedIdentityByLabels
// under both --policy-cidr-match-mode settings.
func TestLookupReservedRules(t *testing.T) {
	for _, tc := range []struct {
		labels         []string
		without, nodes NumericIdentity
	}{
		{[]string{"reserved:host"}, 1, 1},
		{[]string{"reserved:host", "k8s:app=x"}, 1, 1},            // host with anything is the host
		{[]string{"reserved:host", "reserved:remote-node"}, 1, 1}, // still the host
		{[]string{"reserved:host", "reserved:kube-apiserver"}, 1, 1},
		{[]string{"reserved:host=x"}, 1, 1},                   // one reserved label: its name counts
		{[]string{"reserved:world"}, 2, 2},                    // alone
		{[]string{"reserved:world", "cidr:10.0.0.0/8"}, 0, 0}, // a CIDR identity
		{[]string{"reserved:remote-node"}, 6, 0},
		{[]string{"reserved:remote-node", "cidr:192.168.1.10/32"}, 6, 0},
		{[]string{"reserved:remote-node", "k8s:app=x"}, 6, 0},
		{[]string{"reserved:kube-apiserver", "reserved:remote-node"}, 7, 0},
		{[]string{"reserved:kube-apiserver", "reserved:remote-node", "cidr:10.1.0.1/32"}, 7, 0},
		{[]string{"reserved:kube-apiserver"}, 7, 7},                     // alone: the identity by its name
		{[]string{"reserved:kube-apiserver", "cidr:10.1.0.1/32"}, 0, 0}, // not alone, no remote node
		{[]string{"reserved:health", "k8s:app=x"}, 0, 0},                // no claiming by adding a label
		{[]string{"reserved:world=x"}, 2, 2},                            // one reserved label: its name counts
		{[]string{"reserved:world-ipv6"}, 10, 10},
		{[]string{"k8s:world"}, 0, 0},
		{[]string{"reserved:nonsense"}, 0, 0},
		{[]string{"reserved:host", "k8s:io.cilium.fixed-identity=x"}, 0, 0}, // a fixed identity, none defined
		{nil, 0, 0},
	} {
		ls := labels.MustParse(tc.labels...)
		for _, c := range []struct {
			r    *ReservedResolver
			want NumericIdentity
		}{{withoutNodes, tc.without}, {withNodes, tc.nodes}} {
			r := c.r.LookupByLabels(ls)
			got := InvalidIdentity
			if r != nil {
				got = r.ID
			}
			if got != c.want {
				t.Errorf("nodes=%v: LookupByLabels(%v) = %d, want %d", c.r.Config().PolicyCIDRMatchesNodes, tc.labels, got, c.want)
			}
		}
		// The package-level lookup holds in every mode.
		r := LookupReserved(ls)
		got := InvalidIdentity
		if r != nil {
			got = r.ID
		}
		if got != tc.nodes {
			t.Errorf("LookupReserved(%v) = %d, want %d", tc.labels, got, tc.nodes)
		}
	}
}

// TestReservedKeepsLabels checks that the host, remote-node and
// kube-apiserver identities come back with the caller's label set, and a
// single reserved label with the identity's own set.
func TestReservedKeepsLabels(t *testing.T) {
	for _, tc := range []struct {
		labels []string
		id     NumericIdentity
		want   string
	}{
		{[]string{"reserved:host", "k8s:app=x"}, 1, "k8s:app=x;reserved:host=;"},
		{[]string{"reserved:remote-node", "cidr:192.168.1.10/32"}, 6, "cidr:192.168.1.10/32=;reserved:remote-node=;"},
		{[]string{"reserved:kube-apiserver", "reserved:remote-node", "cidr:10.1.0.1/32"}, 7, "cidr:10.1.0.1/32=;reserved:kube-apiserver=;reserved:remote-node=;"},
		{[]string{"reserved:kube-apiserver"}, 7, "reserved:kube-apiserver=;reserved:remote-node=;"},
		{[]string{"reserved:world=x"}, 2, "reserved:world=;"},
	} {
		r := withoutNodes.LookupByLabels(labels.MustParse(tc.labels...))
		if r == nil || r.ID != tc.id || r.Labels.Canonical() != tc.want {
			t.Errorf("LookupByLabels(%v) = %v, want %d %s", tc.labels, r, tc.id, tc.want)
		}
	}
	if r := withoutNodes.LookupByLabels(labels.MustParse("reserved:host")); r != LookupReservedByID(1) {
		t.Error("the host's own set does not return the shared identity")
	}
}

func TestWellKnownIdentities(t *testing.T) {
	const (
		kubeDNS = "k8s:io.cilium.k8s.policy.cluster=c1;k8s:io.cilium.k8s.policy.serviceaccount=kube-dns;k8s:io.kubernetes.pod.namespace=kube-system;k8s:k8s-app=kube-dns;"
		nsName  = "k8s:io.cilium.k8s.namespace.labels.kubernetes.io/metadata.name="
	)
	want := map[NumericIdentity]string{
		100: "k8s:io.cilium.k8s.policy.cluster=c1;k8s:io.cilium.k8s.policy.serviceaccount=cilium-etcd-sa;k8s:io.cilium/app=etcd-operator;k8s:io.kubernetes.pod.namespace=cilium;",
		101: "k8s:app=etcd;k8s:etcd_cluster=cilium-etcd;k8s:io.cilium.k8s.policy.cluster=c1;k8s:io.cilium.k8s.policy.serviceaccount=default;k8s:io.cilium/app=etcd-operator;k8s:io.kubernetes.pod.namespace=cilium;",
		102: kubeDNS,
		103: "k8s:eks.amazonaws.com/component=kube-dns;" + kubeDNS,
		104: "k8s:io.cilium.k8s.policy.cluster=c1;k8s:io.cilium.k8s.policy.serviceaccount=coredns;k8s:io.kubernetes.pod.namespace=kube-system;k8s:k8s-app=kube-dns;",
		105: "k8s:app.kubernetes.io/name=cilium-operator;k8s:app.kubernetes.io/part-of=cilium;k8s:io.cilium.k8s.policy.cluster=c1;k8s:io.cilium.k8s.policy.serviceaccount=cilium-operator;k8s:io.cilium/app=operator;k8s:io.kubernetes.pod.namespace=cilium;k8s:name=cilium-operator;",
		106: "k8s:eks.amazonaws.com/component=coredns;k8s:io.cilium.k8s.policy.cluster=c1;k8s:io.cilium.k8s.policy.serviceaccount=coredns;k8s:io.kubernetes.pod.namespace=kube-system;k8s:k8s-app=kube-dns;",
		107: "k8s:app.kubernetes.io/name: cilium-etcd-operator=;k8s:app.kubernetes.io/part-of: cilium=;k8s:io.cilium.k8s.policy.cluster=c1;k8s:io.cilium.k8s.policy.serviceaccount=cilium-etcd-operator;k8s:io.cilium/app=etcd-operator;k8s:io.kubernetes.pod.namespace=cilium;k8s:name=cilium-etcd-operator;",
	}
	ids := WellKnownIdentities("c1", "cilium")
	if len(ids) != 16 {
		t.Fatalf("%d well-known identities, want 16", len(ids))
	}
	for i, id := range ids {
		if id.ID != NumericIdentity(100+i) {
			t.Fatalf("well-known %d has ID %d", i, id.ID)
		}
		first, ok := want[id.ID]
		if !ok {
			first = ids[i-8].Labels.Canonical()
		}
		if id.ID >= 108 {
			// The second set adds the namespace-name label, with the same
			// namespace as the pod-namespace label.
			ns, _ := ids[i-8].Labels.Get(PodNamespaceLabelKey)
			extra := labels.MustParse(nsName + ns.Value)
			first = labels.Merge(ids[i-8].Labels, extra).Canonical()
		}
		if got := id.Labels.Canonical(); got != first {
			t.Errorf("well-known %d:\n got %s\nwant %s", id.ID, got, first)
		}
	}

	on := NewReservedResolver(ReservedConfig{WellKnown: true, ClusterName: "c1", CiliumNamespace: "cilium"})
	off := NewReservedResolver(ReservedConfig{ClusterName: "c1", CiliumNamespace: "cilium"})
	dns := labels.MustParse(strings.Split(strings.TrimSuffix(kubeDNS, ";"), ";")...)
	if r := on.LookupByLabels(dns); r == nil || r.ID != 102 {
		t.Errorf("kube-dns set resolves to %v, want 102", r)
	}
	if r := off.LookupByLabels(dns); r != nil {
		t.Errorf("kube-dns set resolves to %v with well-known identities off", r)
	}
	// Only the exact set: another cluster's, or one more label, is not.
	other := labels.Merge(dns, labels.MustParse("k8s:io.cilium.k8s.policy.cluster=c2"))
	more := labels.Merge(dns, labels.MustParse("k8s:pod-template-hash=abc"))
	for _, ls := range []labels.Labels{other, more, dns[1:]} {
		if r := on.LookupByLabels(ls); r != nil {
			t.Errorf("LookupByLabels(%s) = %v, want none", ls, r)
		}
	}
	if r := on.LookupByID(110); r == nil || r.ID != 110 || !r.Labels.Equal(ids[10].Labels) {
		t.Errorf("LookupByID(110) = %v", r)
	}
	if off.LookupByID(102) != nil || on.LookupByID(116) != nil || on.LookupByID(99) != nil {
		t.Error("LookupByID outside the enabled well-known identities")
	}
	if !on.IsWellKnown(115) || on.IsWellKnown(116) || off.IsWellKnown(102) {
		t.Error("IsWellKnown")
	}
	if n := len(on.Identities()); n != 26 {
		t.Errorf("%d identities with well-known ones, want 26", n)
	}
	if n := len(off.Identities()); n != 10 {
		t.Errorf("%d identities without well-known ones, want 10", n)
	}
}

func TestScopeForLabels(t *testing.T) {
	for _, tc := range []struct {
		labels []string
		want   Scope
	}{
		{[]string{"cidr:10.0.0.0/8", "reserved:world"}, ScopeLocal},
		{[]string{"fqdn:example.com"}, ScopeLocal},
		{[]string{"cidr:192.168.1.10/32", "reserved:remote-node"}, ScopeRemoteNode},
		{[]string{"k8s:app=web", "reserved:remote-node"}, ScopeRemoteNode},
		{[]string{"k8s:app=web"}, ScopeGlobal},
		{[]string{"cidr:10.0.0.0/8", "k8s:app=web"}, ScopeGlobal},
		{nil, ScopeGlobal},
	} {
		if got := ScopeForLabels(labels.MustParse(tc.labels...)); got != tc.want {
			t.Errorf("ScopeForLabels(%v) = %s, want %s", tc.labels, got, tc.want)
		}
	}
}

func TestNumericIdentity(t *testing.T) {
	if NumericIdentity(16777217).Scope() != ScopeLocal || NumericIdentity(33554433).Scope() != ScopeRemoteNode || NumericIdentity(256).Scope() != ScopeGlobal {
		t.Fatal("scopes")
	}
	if !NumericIdentity(16777217).HasLocalScope() || !NumericIdentity(33554433).HasLocalScope() || NumericIdentity(65535).HasLocalScope() {
		t.Fatal("HasLocalScope")
	}
	if !NumericIdentity(1).IsReserved() || !NumericIdentity(255).IsReserved() || NumericIdentity(0).IsReserved() || NumericIdentity(256).IsReserved() {
		t.Fatal("IsReserved")
	}
	if MinUserReservedIdentity != 128 || MaxUserReservedIdentity != 255 || MinAllocatorIdentity != 256 {
		t.Fatal("ranges")
	}
	if id, err := ParseNumericIdentity("16777217"); err != nil || id != 16777217 {
		t.Fatal(id, err)
	}
	for _, bad := range []string{"", "-1", "4294967296", "x"} {
		if _, err := ParseNumericIdentity(bad); err == nil {
			t.Errorf("ParseNumericIdentity(%q) accepted", bad)
		}
	}
}

func TestNumericIdentityValidate(t *testing.T) {
	for _, tc := range []struct {
		id NumericIdentity
		ok bool
	}{
		{0, false},
		{1, true},
		{255, true},
		{256, true},
		{0xFFFFFF, true},
		{0x01000000, false},
		{0x01000001, true},
		{0x01FFFFFF, true},
		{0x02000000, false},
		{0x02000001, true},
		{0x02FFFFFF, true},
		{0x03000000, false},
		{0x03000001, false},
		{0xFF000001, false},
		{4294967295, false},
	} {
		err := tc.id.Validate()
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrInvalidNumericIdentity)) {
			t.Errorf("Validate(%d) = %v, want ok=%v", tc.id, err, tc.ok)
		}
	}
}

func TestClusterRanges(t *testing.T) {
	for _, tc := range []struct {
		maxc, id uint32
		min, max NumericIdentity
	}{
		{255, 0, 256, 65535},
		{255, 1, 65536, 131071},
		{255, 255, 255 << 16, 0xFFFFFF},
		{511, 0, 256, 32767},
		{511, 1, 32768, 65535},
		{511, 511, 511 << 15, 0xFFFFFF},
		{0, 2, 2 << 16, 3<<16 - 1}, // zero means 255
	} {
		c := ClusterInfo{ID: tc.id, Name: "c", MaxConnectedClusters: tc.maxc}
		if c.MinID() != tc.min || c.MaxID() != tc.max {
			t.Errorf("max %d cluster %d: %d..%d, want %d..%d", tc.maxc, tc.id, c.MinID(), c.MaxID(), tc.min, tc.max)
		}
		if tc.id != 0 && ClusterID(c.MinID(), tc.maxc) != tc.id {
			t.Errorf("ClusterID(%d) = %d", c.MinID(), ClusterID(c.MinID(), tc.maxc))
		}
	}
	if ClusterIDShift(255) != 16 || ClusterIDShift(511) != 15 {
		t.Fatal("shift")
	}
}

func TestClusterValidation(t *testing.T) {
	for _, tc := range []struct {
		c    ClusterInfo
		want error
	}{
		{ClusterInfo{ID: 0, Name: "default"}, nil},
		{ClusterInfo{ID: 1, Name: "default"}, ErrDefaultNameNonZeroID},
		{ClusterInfo{ID: 1, Name: "c1"}, nil},
		{ClusterInfo{ID: 255, Name: "c1"}, nil},
		{ClusterInfo{ID: 256, Name: "c1"}, ErrInvalidClusterID},
		{ClusterInfo{ID: 511, Name: "c1", MaxConnectedClusters: 511}, nil},
		{ClusterInfo{ID: 512, Name: "c1", MaxConnectedClusters: 511}, ErrInvalidClusterID},
		{ClusterInfo{Name: "c1", MaxConnectedClusters: 100}, ErrInvalidMaxConnected},
		{ClusterInfo{Name: ""}, ErrInvalidClusterName},
		{ClusterInfo{Name: "Upper"}, ErrInvalidClusterName},
		{ClusterInfo{Name: "-lead"}, ErrInvalidClusterName},
		{ClusterInfo{Name: "trail-"}, ErrInvalidClusterName},
		{ClusterInfo{Name: "a"}, nil},
		{ClusterInfo{Name: "a-b-0"}, nil},
		{ClusterInfo{Name: "abcdefghijklmnopqrstuvwxyz012345"}, nil},
		{ClusterInfo{Name: "abcdefghijklmnopqrstuvwxyz0123456"}, ErrInvalidClusterName},
	} {
		err := tc.c.Validate()
		if (tc.want == nil) != (err == nil) || (tc.want != nil && !errors.Is(err, tc.want)) {
			t.Errorf("%+v.Validate() = %v, want %v", tc.c, err, tc.want)
		}
	}
}
