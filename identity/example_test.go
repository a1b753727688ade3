package identity_test

import (
	"fmt"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// The scope of a label set decides where its identity comes from: CIDR-like
// sets are numbered node-locally, the others share cluster-wide numbers.
func ExampleScopeForLabels() {
	for _, ls := range []labels.Labels{
		labels.MustParse("k8s:app=web", "k8s:io.kubernetes.pod.namespace=default"),
		labels.MustParse("cidr:10.0.0.0/8", "reserved:world"),
		labels.MustParse("cidr:192.168.1.10/32", "reserved:remote-node"),
	} {
		fmt.Println(identity.ScopeForLabels(ls), ls)
	}
	// Output:
	// global k8s:app=web,k8s:io.kubernetes.pod.namespace=default
	// local cidr:10.0.0.0/8,reserved:world
	// remote-node cidr:192.168.1.10/32,reserved:remote-node
}

// Reserved label sets have fixed numbers, the same on every node.
func ExampleLookupReserved() {
	id := identity.LookupReserved(labels.MustParse("reserved:world"))
	fmt.Println(id.ID, id.Labels)
	fmt.Println(identity.LookupReservedByID(identity.ReservedIdentityHost).Labels)
	// Output:
	// 2 reserved:world
	// reserved:host
}

// Each cluster of a cluster mesh allocates global identities from its own
// range, which the cluster ID selects.
func ExampleClusterInfo() {
	c := identity.ClusterInfo{ID: 3, Name: "east"}
	if err := c.Validate(); err != nil {
		panic(err)
	}
	fmt.Println(c.MinID(), c.MaxID())
	fmt.Println(identity.ClusterID(c.MinID(), 255))
	n, err := identity.ParseNumericIdentity("16777217")
	fmt.Println(n, n.Scope(), err)
	// Output:
	// 196608 262143
	// 3
	// 16777217 local <nil>
}
