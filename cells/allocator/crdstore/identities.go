package crdstore

import (
	"fmt"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// The store's mapping between label sets and CiliumIdentity objects, and
// its choice among the objects of one label set, for the tools that read
// and write the objects without a running store (`identityd migrate`):
// what they plan is then what every node answers.

// FieldManager is the field manager the store creates CiliumIdentity
// objects with. The API server records it in the object's managedFields,
// which is how the choice among a label set's objects (PickIdentity) tells
// the objects identityd created from a Cilium agent's; a tool that creates
// objects for identityd (a migration) sends it too.
const FieldManager = fieldManager

// NewIdentityObject returns the CiliumIdentity of id for lbls, as the store
// creates it: security-labels holds every label, metadata.labels the k8s
// labels Cilium puts there that the API server accepts.
func NewIdentityObject(id identity.NumericIdentity, lbls labels.Labels) *CiliumIdentity {
	return newIdentityObject(id, lbls)
}

// ParseIdentityName reads an object's name as the store does: the decimal
// form of a numeric identity, without sign or leading zeros.
func ParseIdentityName(name string) (identity.NumericIdentity, error) { return parseName(name) }

// ParseSecurityLabels reads an object's security-labels as the store does:
// "source:key" to value, the source ending at the first ':'.
func ParseSecurityLabels(m map[string]string) (labels.Labels, error) { return parseSecurityLabels(m) }

// PickIdentity returns the object whose ID every node of cluster answers
// for a label set, given objs, the label set's objects as the API server
// holds them (docs/crd-store.md, "Lookup"): the earliest by creation
// second, counted a head start earlier for an object near the start of
// the label set's probe sequence or created with FieldManager; of the same
// rank, the one earlier on the sequence. Objects the store leaves out (a name
// that is not an ID of the cluster's range, security-labels that do not
// parse) play no part; nil when none is left. Objects of different label
// sets are an error.
func PickIdentity(cluster identity.ClusterInfo, objs []*CiliumIdentity) (*CiliumIdentity, error) {
	rng := clusterRange(cluster)
	es := make([]*entry, 0, len(objs))
	for _, obj := range objs {
		e, err := parseEntry(rng, obj)
		if err != nil {
			continue
		}
		if len(es) > 0 && e.key != es[0].key {
			return nil, fmt.Errorf("objects %s and %s hold different label sets", es[0].obj.Name, obj.Name)
		}
		es = append(es, e)
	}
	if len(es) == 0 {
		return nil, nil
	}
	return pickOn(rng, es[0].key, es).obj, nil
}
