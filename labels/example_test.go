package labels_test

import (
	"fmt"
	"net/netip"

	"github.com/identityd/identityd/labels"
)

// A label set parsed from Cilium's text form is sorted by key; its
// canonical string is the key under which etcd and the allocators keep it.
func ExampleParse() {
	ls, err := labels.Parse("k8s:io.kubernetes.pod.namespace=default", "k8s:app=web")
	if err != nil {
		panic(err)
	}
	fmt.Println(ls)
	fmt.Println(ls.Canonical())

	back, err := labels.ParseCanonical(ls.Canonical())
	fmt.Println(back.Equal(ls), err)

	// A key given twice is refused rather than silently merged.
	_, err = labels.Parse("k8s:app=web", "k8s:app=db")
	fmt.Println(err)
	// Output:
	// k8s:app=web,k8s:io.kubernetes.pod.namespace=default
	// k8s:app=web;k8s:io.kubernetes.pod.namespace=default;
	// true <nil>
	// invalid label "k8s:app=db": duplicate key
}

// The labels of a CIDR identity: the prefix and the world label; its
// sources make the label set node-local.
func ExampleFromPrefix() {
	ls := labels.FromPrefix(netip.MustParsePrefix("10.0.0.0/8"), false)
	fmt.Println(ls)
	fmt.Println(ls.OnlySources(labels.SourceCIDR, labels.SourceReserved))
	// Output:
	// cidr:10.0.0.0/8,reserved:world
	// true
}
