package identity

import (
	"errors"
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
		if r := LookupReserved(got[i].Labels); r == nil || r.ID != w.id {
			t.Errorf("LookupReserved(%s) = %v, want %d", got[i].Labels, r, w.id)
		}
	}
	if LookupReservedByID(0) != nil || LookupReservedByID(11) != nil || LookupReservedByID(200) != nil {
		t.Error("non-reserved IDs resolved")
	}
}

func TestLookupReservedRules(t *testing.T) {
	for _, tc := range []struct {
		labels []string
		want   NumericIdentity
	}{
		{[]string{"reserved:host"}, 1},
		{[]string{"reserved:host", "k8s:app=x"}, 1},            // host with anything is the host
		{[]string{"reserved:host", "reserved:remote-node"}, 1}, // still the host
		{[]string{"reserved:world"}, 2},                        // alone
		{[]string{"reserved:world", "cidr:10.0.0.0/8"}, 0},     // a CIDR identity
		{[]string{"reserved:kube-apiserver", "reserved:remote-node"}, 7},
		{[]string{"reserved:kube-apiserver"}, 0},      // not alone a reserved set
		{[]string{"reserved:health", "k8s:app=x"}, 0}, // no claiming by adding a label
		{[]string{"reserved:world=x"}, 0},             // reserved labels have no value
		{[]string{"k8s:world"}, 0},
		{[]string{"reserved:nonsense"}, 0},
		{nil, 0},
	} {
		r := LookupReserved(labels.MustParse(tc.labels...))
		got := InvalidIdentity
		if r != nil {
			got = r.ID
		}
		if got != tc.want {
			t.Errorf("LookupReserved(%v) = %d, want %d", tc.labels, got, tc.want)
		}
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
