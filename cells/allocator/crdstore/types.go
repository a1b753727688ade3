package crdstore

import (
	"encoding/json"
	"fmt"
	"slices"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"

	"github.com/identityd/identityd/cells/allocator/globalstore"
)

// The API groups, versions and resources of the objects the store keeps.
const (
	// CiliumGroup and CiliumVersion are Cilium's API group and the version
	// of its CiliumIdentity objects.
	CiliumGroup   = "cilium.io"
	CiliumVersion = "v2"
	// IdentityGroup and IdentityVersion are identityd's own API group and
	// the version of its IdentityNode and IdentityLease objects.
	IdentityGroup   = "identityd.io"
	IdentityVersion = "v1"
	// CiliumSliceVersion is the version of Cilium's CiliumEndpointSlice
	// objects (CiliumEndpoint objects are of CiliumVersion).
	CiliumSliceVersion = "v2alpha1"

	// HeartbeatAnnotation is the mark Cilium's operator (and identityd's
	// garbage collection) sets on an identity it is about to delete: an
	// RFC 3339 time. A node that uses a marked identity removes it.
	HeartbeatAnnotation = "io.cilium.heartbeat"
	// stepAnnotation is the time (RFC 3339) a node last wrote, before
	// creating an identity further along a probe sequence, on a marked
	// identity its walk stepped over: the collection does not delete a
	// marked identity whose step annotation is younger than gcStepWindow
	// (docs/crd-store.md, "Garbage collection").
	stepAnnotation = "identityd.io/stepped-over"
)

// The resources, for clients that address them by GroupVersionResource.
var (
	CiliumIdentityResource = schema.GroupVersionResource{Group: CiliumGroup, Version: CiliumVersion, Resource: "ciliumidentities"}
	IdentityNodeResource   = schema.GroupVersionResource{Group: IdentityGroup, Version: IdentityVersion, Resource: "identitynodes"}
	IdentityLeaseResource  = schema.GroupVersionResource{Group: IdentityGroup, Version: IdentityVersion, Resource: "identityleases"}
	// The Cilium objects whose identities the garbage collection counts as
	// used; the store only lists them.
	CiliumEndpointResource      = schema.GroupVersionResource{Group: CiliumGroup, Version: CiliumVersion, Resource: "ciliumendpoints"}
	CiliumEndpointSliceResource = schema.GroupVersionResource{Group: CiliumGroup, Version: CiliumSliceVersion, Resource: "ciliumendpointslices"}
)

// CiliumIdentity is Cilium's object of one global identity: its name is the
// numeric identity in decimal, SecurityLabels the whole label set
// ("source:key" to value), and its metadata.labels the subset of it that
// Kubernetes accepts as object labels.
type CiliumIdentity struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`

	SecurityLabels map[string]string `json:"security-labels"`
}

// CiliumIdentityList is a list of CiliumIdentity objects.
type CiliumIdentityList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata"`

	Items []CiliumIdentity `json:"items"`
}

// IdentityNode is one node's record of the global identities it uses. It
// outlives the node's restart; once RenewTime is older than
// LeaseDurationSeconds the node counts as gone and its uses no longer
// protect the identities.
type IdentityNode struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`

	Spec IdentityNodeSpec `json:"spec"`
}

// IdentityNodeSpec is what a node records.
type IdentityNodeSpec struct {
	// Identities are the numeric identities the node uses, sorted and
	// without duplicates.
	Identities []uint32 `json:"identities"`
	// RenewTime is when the node last wrote the object.
	RenewTime metav1.MicroTime `json:"renewTime"`
	// LeaseDurationSeconds is how long after RenewTime the record counts.
	LeaseDurationSeconds int32 `json:"leaseDurationSeconds"`
	// Holder names the agent process that writes the record, so that a
	// second agent with the same node name refuses to start.
	Holder *globalstore.NodeClaim `json:"holder,omitempty"`
}

// UnmarshalJSON reads renewTime as any RFC 3339 time, which is what the
// CRD's date-time format lets anyone write (a hand-made record, another
// tool): metav1.MicroTime alone takes six fractional digits only, and one
// object it refuses would fail the decoding of the whole listing, and so
// the collector's every run.
func (in *IdentityNodeSpec) UnmarshalJSON(data []byte) error {
	var raw struct {
		Identities           []uint32               `json:"identities"`
		RenewTime            *string                `json:"renewTime"`
		LeaseDurationSeconds int32                  `json:"leaseDurationSeconds"`
		Holder               *globalstore.NodeClaim `json:"holder"`
	}
	if err := json.Unmarshal(data, &raw); err != nil {
		return err
	}
	*in = IdentityNodeSpec{Identities: raw.Identities, LeaseDurationSeconds: raw.LeaseDurationSeconds, Holder: raw.Holder}
	if raw.RenewTime == nil || *raw.RenewTime == "" {
		return nil
	}
	t, err := time.Parse(time.RFC3339Nano, *raw.RenewTime)
	if err != nil {
		return fmt.Errorf("renewTime: %w", err)
	}
	in.RenewTime = metav1.NewMicroTime(t.Local())
	return nil
}

// IdentityNodeList is a list of IdentityNode objects.
type IdentityNodeList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata"`

	Items []IdentityNode `json:"items"`
}

// Expired reports whether the node's record no longer counts at now.
func (n *IdentityNode) Expired(now metav1.Time) bool {
	lease := int64(n.Spec.LeaseDurationSeconds)
	return n.Spec.RenewTime.Unix()+lease < now.Unix()
}

// DeepCopyObject implements runtime.Object.
func (in *CiliumIdentity) DeepCopyObject() runtime.Object { return in.DeepCopy() }

// DeepCopy returns a copy that shares nothing with in.
func (in *CiliumIdentity) DeepCopy() *CiliumIdentity {
	if in == nil {
		return nil
	}
	out := &CiliumIdentity{TypeMeta: in.TypeMeta}
	in.ObjectMeta.DeepCopyInto(&out.ObjectMeta)
	if in.SecurityLabels != nil {
		out.SecurityLabels = make(map[string]string, len(in.SecurityLabels))
		for k, v := range in.SecurityLabels {
			out.SecurityLabels[k] = v
		}
	}
	return out
}

// DeepCopyObject implements runtime.Object.
func (in *CiliumIdentityList) DeepCopyObject() runtime.Object {
	if in == nil {
		return nil
	}
	out := &CiliumIdentityList{TypeMeta: in.TypeMeta}
	in.ListMeta.DeepCopyInto(&out.ListMeta)
	if in.Items != nil {
		out.Items = make([]CiliumIdentity, len(in.Items))
		for i := range in.Items {
			out.Items[i] = *in.Items[i].DeepCopy()
		}
	}
	return out
}

// DeepCopyObject implements runtime.Object.
func (in *IdentityNode) DeepCopyObject() runtime.Object { return in.DeepCopy() }

// DeepCopy returns a copy that shares nothing with in.
func (in *IdentityNode) DeepCopy() *IdentityNode {
	if in == nil {
		return nil
	}
	out := &IdentityNode{TypeMeta: in.TypeMeta}
	in.ObjectMeta.DeepCopyInto(&out.ObjectMeta)
	out.Spec = in.Spec
	out.Spec.Identities = slices.Clone(in.Spec.Identities)
	in.Spec.RenewTime.DeepCopyInto(&out.Spec.RenewTime)
	return out
}

// DeepCopyObject implements runtime.Object.
func (in *IdentityNodeList) DeepCopyObject() runtime.Object {
	if in == nil {
		return nil
	}
	out := &IdentityNodeList{TypeMeta: in.TypeMeta}
	in.ListMeta.DeepCopyInto(&out.ListMeta)
	if in.Items != nil {
		out.Items = make([]IdentityNode, len(in.Items))
		for i := range in.Items {
			out.Items[i] = *in.Items[i].DeepCopy()
		}
	}
	return out
}

// IdentityLease is the lock earlier versions elected the collector with
// (deprecated): the holder of the one named identity-gc-<cluster ID> ran
// the cluster's garbage collection. The collector now holds the
// coordination.k8s.io/v1 Lease of that name and this lock as well (see
// election.go). Its spec is coordination.k8s.io/v1's LeaseSpec (the fields
// client-go's leader election writes), which the election also decodes
// Leases into.
type IdentityLease struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`

	Spec IdentityLeaseSpec `json:"spec"`
}

// IdentityLeaseSpec is the lock's state, as in coordination.k8s.io/v1.
type IdentityLeaseSpec struct {
	// HolderIdentity names the holder: its node name and process
	// instance. Empty once the holder released the lock.
	HolderIdentity *string `json:"holderIdentity,omitempty"`
	// LeaseDurationSeconds is how long after RenewTime the others wait
	// before they take the lock.
	LeaseDurationSeconds *int32 `json:"leaseDurationSeconds,omitempty"`
	// AcquireTime is when the holder took the lock, RenewTime when it
	// last renewed it.
	AcquireTime *metav1.MicroTime `json:"acquireTime,omitempty"`
	RenewTime   *metav1.MicroTime `json:"renewTime,omitempty"`
	// LeaseTransitions counts the changes of holder.
	LeaseTransitions *int32 `json:"leaseTransitions,omitempty"`
}

// UnmarshalJSON reads the times in any RFC 3339 form (the CRD's date-time
// format), as IdentityNodeSpec does: one written by hand must not make
// the lock unreadable, which would leave the cluster without a collector.
func (in *IdentityLeaseSpec) UnmarshalJSON(data []byte) error {
	var raw struct {
		HolderIdentity       *string `json:"holderIdentity"`
		LeaseDurationSeconds *int32  `json:"leaseDurationSeconds"`
		AcquireTime          *string `json:"acquireTime"`
		RenewTime            *string `json:"renewTime"`
		LeaseTransitions     *int32  `json:"leaseTransitions"`
	}
	if err := json.Unmarshal(data, &raw); err != nil {
		return err
	}
	*in = IdentityLeaseSpec{HolderIdentity: raw.HolderIdentity, LeaseDurationSeconds: raw.LeaseDurationSeconds, LeaseTransitions: raw.LeaseTransitions}
	for _, f := range []struct {
		name string
		s    *string
		t    **metav1.MicroTime
	}{{"acquireTime", raw.AcquireTime, &in.AcquireTime}, {"renewTime", raw.RenewTime, &in.RenewTime}} {
		if f.s == nil || *f.s == "" {
			continue
		}
		t, err := time.Parse(time.RFC3339Nano, *f.s)
		if err != nil {
			return fmt.Errorf("%s: %w", f.name, err)
		}
		mt := metav1.NewMicroTime(t.Local())
		*f.t = &mt
	}
	return nil
}

// IdentityLeaseList is a list of IdentityLease objects.
type IdentityLeaseList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata"`

	Items []IdentityLease `json:"items"`
}

// DeepCopyObject implements runtime.Object.
func (in *IdentityLease) DeepCopyObject() runtime.Object { return in.DeepCopy() }

// DeepCopy returns a copy that shares nothing with in.
func (in *IdentityLease) DeepCopy() *IdentityLease {
	if in == nil {
		return nil
	}
	out := &IdentityLease{TypeMeta: in.TypeMeta}
	in.ObjectMeta.DeepCopyInto(&out.ObjectMeta)
	out.Spec = IdentityLeaseSpec{
		HolderIdentity:       clonePtr(in.Spec.HolderIdentity),
		LeaseDurationSeconds: clonePtr(in.Spec.LeaseDurationSeconds),
		AcquireTime:          in.Spec.AcquireTime.DeepCopy(),
		RenewTime:            in.Spec.RenewTime.DeepCopy(),
		LeaseTransitions:     clonePtr(in.Spec.LeaseTransitions),
	}
	return out
}

func clonePtr[T any](p *T) *T {
	if p == nil {
		return nil
	}
	v := *p
	return &v
}

// DeepCopyObject implements runtime.Object.
func (in *IdentityLeaseList) DeepCopyObject() runtime.Object {
	if in == nil {
		return nil
	}
	out := &IdentityLeaseList{TypeMeta: in.TypeMeta}
	in.ListMeta.DeepCopyInto(&out.ListMeta)
	if in.Items != nil {
		out.Items = make([]IdentityLease, len(in.Items))
		for i := range in.Items {
			out.Items[i] = *in.Items[i].DeepCopy()
		}
	}
	return out
}

// newScheme returns a scheme that knows the store's types, for its REST
// clients' codecs. Each store builds its own: no package state.
func newScheme() *runtime.Scheme {
	s := runtime.NewScheme()
	cilium := schema.GroupVersion{Group: CiliumGroup, Version: CiliumVersion}
	s.AddKnownTypes(cilium, &CiliumIdentity{}, &CiliumIdentityList{})
	metav1.AddToGroupVersion(s, cilium)
	own := schema.GroupVersion{Group: IdentityGroup, Version: IdentityVersion}
	s.AddKnownTypes(own, &IdentityNode{}, &IdentityNodeList{}, &IdentityLease{}, &IdentityLeaseList{})
	metav1.AddToGroupVersion(s, own)
	return s
}

func newCodecs() serializer.CodecFactory { return serializer.NewCodecFactory(newScheme()) }
