package crdstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/identityd/identityd/internal/crdclient"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
)

// The names of the CRDs the store needs.
const (
	CiliumIdentityCRDName = "ciliumidentities." + CiliumGroup
	IdentityNodeCRDName   = "identitynodes." + IdentityGroup
	IdentityLeaseCRDName  = "identityleases." + IdentityGroup
)

// Schema versions, in the CRD label each owner reads to decide whether the
// installed CRD is outdated. Cilium's operator compares its own label with
// its version (1.29.13 in v1.16): identityd installs Cilium's schema under
// that version so that neither rewrites the other's.
const (
	ciliumSchemaVersionLabel = "io.cilium.k8s.crd.schema.version"
	ciliumSchemaVersion      = "1.29.13"
	ownSchemaVersionLabel    = "identityd.io/crd-schema-version"
	ownSchemaVersion         = "1.1.0"
)

// ErrCRDRegistration: a CRD the store needs is missing or outdated, and
// could not be installed.
var ErrCRDRegistration = errors.New("registering a custom resource definition failed")

// crdEstablishTimeout bounds the wait for a created or updated CRD to be
// served.
const crdEstablishTimeout = time.Minute

// CiliumIdentityCRD returns the definition of Cilium's CiliumIdentity CRD,
// with Cilium v1.16's schema.
func CiliumIdentityCRD() *apiextensionsv1.CustomResourceDefinition {
	return &apiextensionsv1.CustomResourceDefinition{
		ObjectMeta: metav1.ObjectMeta{
			Name:   CiliumIdentityCRDName,
			Labels: map[string]string{ciliumSchemaVersionLabel: ciliumSchemaVersion},
		},
		Spec: apiextensionsv1.CustomResourceDefinitionSpec{
			Group: CiliumGroup,
			Names: apiextensionsv1.CustomResourceDefinitionNames{
				Kind:       "CiliumIdentity",
				ListKind:   "CiliumIdentityList",
				Plural:     "ciliumidentities",
				Singular:   "ciliumidentity",
				ShortNames: []string{"ciliumid"},
				Categories: []string{"cilium"},
			},
			Scope: apiextensionsv1.ClusterScoped,
			Versions: []apiextensionsv1.CustomResourceDefinitionVersion{{
				Name:    CiliumVersion,
				Served:  true,
				Storage: true,
				AdditionalPrinterColumns: []apiextensionsv1.CustomResourceColumnDefinition{
					{Name: "Namespace", Type: "string", Description: "The namespace of the entity", JSONPath: `.metadata.labels.io\.kubernetes\.pod\.namespace`},
					{Name: "Age", Type: "date", Description: "The age of the identity", JSONPath: ".metadata.creationTimestamp"},
				},
				Subresources: &apiextensionsv1.CustomResourceSubresources{Status: &apiextensionsv1.CustomResourceSubresourceStatus{}},
				Schema: &apiextensionsv1.CustomResourceValidation{OpenAPIV3Schema: &apiextensionsv1.JSONSchemaProps{
					Description: "CiliumIdentity is a CRD that represents an identity managed by Cilium. The name is the numeric identity; security-labels is the whole label set that defines it; the object's labels are the Kubernetes-compatible subset.",
					Type:        "object",
					Required:    []string{"metadata", "security-labels"},
					Properties: map[string]apiextensionsv1.JSONSchemaProps{
						"apiVersion": {Type: "string", Description: "APIVersion defines the versioned schema of this representation of an object."},
						"kind":       {Type: "string", Description: "Kind is a string value representing the REST resource this object represents."},
						"metadata":   {Type: "object"},
						"security-labels": {
							Type:        "object",
							Description: "SecurityLabels is the source-of-truth set of labels for this identity.",
							AdditionalProperties: &apiextensionsv1.JSONSchemaPropsOrBool{
								Allows: true,
								Schema: &apiextensionsv1.JSONSchemaProps{Type: "string"},
							},
						},
					},
				}},
			}},
		},
	}
}

// IdentityNodeCRD returns the definition of identityd's IdentityNode CRD.
func IdentityNodeCRD() *apiextensionsv1.CustomResourceDefinition {
	minLease := float64(1)
	maxID := float64(1<<32 - 1)
	zero := float64(0)
	return &apiextensionsv1.CustomResourceDefinition{
		ObjectMeta: metav1.ObjectMeta{
			Name:   IdentityNodeCRDName,
			Labels: map[string]string{ownSchemaVersionLabel: ownSchemaVersion},
		},
		Spec: apiextensionsv1.CustomResourceDefinitionSpec{
			Group: IdentityGroup,
			Names: apiextensionsv1.CustomResourceDefinitionNames{
				Kind:     "IdentityNode",
				ListKind: "IdentityNodeList",
				Plural:   "identitynodes",
				Singular: "identitynode",
			},
			Scope: apiextensionsv1.ClusterScoped,
			Versions: []apiextensionsv1.CustomResourceDefinitionVersion{{
				Name:    IdentityVersion,
				Served:  true,
				Storage: true,
				AdditionalPrinterColumns: []apiextensionsv1.CustomResourceColumnDefinition{
					{Name: "Renewed", Type: "date", Description: "When the node last renewed its record", JSONPath: ".spec.renewTime"},
					{Name: "Lease", Type: "integer", Description: "Seconds the record counts after its renewal", JSONPath: ".spec.leaseDurationSeconds"},
				},
				Schema: &apiextensionsv1.CustomResourceValidation{OpenAPIV3Schema: &apiextensionsv1.JSONSchemaProps{
					Description: "IdentityNode is one identityd node's record of the global identities it uses; it counts until renewTime plus leaseDurationSeconds.",
					Type:        "object",
					Required:    []string{"metadata", "spec"},
					Properties: map[string]apiextensionsv1.JSONSchemaProps{
						"apiVersion": {Type: "string"},
						"kind":       {Type: "string"},
						"metadata":   {Type: "object"},
						"spec": {
							Type:     "object",
							Required: []string{"identities", "renewTime", "leaseDurationSeconds"},
							Properties: map[string]apiextensionsv1.JSONSchemaProps{
								"identities": {
									Type:        "array",
									Description: "The numeric identities the node uses, sorted.",
									Items: &apiextensionsv1.JSONSchemaPropsOrArray{Schema: &apiextensionsv1.JSONSchemaProps{
										Type: "integer", Format: "int64", Minimum: &zero, Maximum: &maxID,
									}},
								},
								"renewTime":            {Type: "string", Format: "date-time", Description: "When the node last wrote the record."},
								"leaseDurationSeconds": {Type: "integer", Format: "int32", Minimum: &minLease, Description: "Seconds after renewTime during which the record counts."},
								"holder": {
									Type:        "object",
									Description: "The agent process that writes the record: a second agent with the same node name refuses to start while it runs.",
									Properties: map[string]apiextensionsv1.JSONSchemaProps{
										"instance": {Type: "string"},
										"host":     {Type: "string"},
										"pid":      {Type: "integer", Format: "int64"},
									},
								},
							},
						},
					},
				}},
			}},
		},
	}
}

// IdentityLeaseCRD returns the definition of identityd's IdentityLease CRD:
// coordination.k8s.io/v1's Lease, for API servers that serve CRDs alone.
func IdentityLeaseCRD() *apiextensionsv1.CustomResourceDefinition {
	zero := float64(0)
	one := float64(1)
	return &apiextensionsv1.CustomResourceDefinition{
		ObjectMeta: metav1.ObjectMeta{
			Name:   IdentityLeaseCRDName,
			Labels: map[string]string{ownSchemaVersionLabel: ownSchemaVersion},
		},
		Spec: apiextensionsv1.CustomResourceDefinitionSpec{
			Group: IdentityGroup,
			Names: apiextensionsv1.CustomResourceDefinitionNames{
				Kind:     "IdentityLease",
				ListKind: "IdentityLeaseList",
				Plural:   "identityleases",
				Singular: "identitylease",
			},
			Scope: apiextensionsv1.ClusterScoped,
			Versions: []apiextensionsv1.CustomResourceDefinitionVersion{{
				Name:    IdentityVersion,
				Served:  true,
				Storage: true,
				AdditionalPrinterColumns: []apiextensionsv1.CustomResourceColumnDefinition{
					{Name: "Holder", Type: "string", Description: "The node process that holds the lock", JSONPath: ".spec.holderIdentity"},
					{Name: "Renewed", Type: "date", Description: "When the holder last renewed the lock", JSONPath: ".spec.renewTime"},
				},
				Schema: &apiextensionsv1.CustomResourceValidation{OpenAPIV3Schema: &apiextensionsv1.JSONSchemaProps{
					Description: "Deprecated: IdentityLease is the lock earlier identityd versions elected the collector of unused identities with (the holder of identity-gc-<cluster ID>), with the fields of coordination.k8s.io/v1's Lease. The collector is now the holder of the Lease identity-gc-<cluster ID> in the agents' namespace, and holds this lock as well, so that nodes of an earlier version do not collect beside it during an upgrade.",
					Type:        "object",
					Required:    []string{"metadata", "spec"},
					Properties: map[string]apiextensionsv1.JSONSchemaProps{
						"apiVersion": {Type: "string"},
						"kind":       {Type: "string"},
						"metadata":   {Type: "object"},
						"spec": {
							Type: "object",
							Properties: map[string]apiextensionsv1.JSONSchemaProps{
								"holderIdentity":       {Type: "string", Description: "The holder: its node name and process instance; empty once released."},
								"leaseDurationSeconds": {Type: "integer", Format: "int32", Minimum: &one, Description: "Seconds after renewTime before another node may take the lock."},
								"acquireTime":          {Type: "string", Format: "date-time", Description: "When the holder took the lock."},
								"renewTime":            {Type: "string", Format: "date-time", Description: "When the holder last renewed the lock."},
								"leaseTransitions":     {Type: "integer", Format: "int32", Minimum: &zero, Description: "How many times the holder changed."},
							},
						},
					},
				}},
			}},
		},
	}
}

// RegisterCRDs makes sure the API server serves the CRDs the store needs:
// each is created when missing and updated when its schema version label
// is older than this store's (as Cilium's operator does), then waited for
// until it is established. A CRD already at this version or newer is left
// as it is. Without the right to read, create or update CRDs the error
// names the CRD and the verb refused, so an operator knows which RBAC rule
// is missing (or that the CRD must be installed by someone who has it).
func RegisterCRDs(ctx context.Context, cfg *rest.Config) error {
	crds, err := crdclient.New(cfg)
	if err != nil {
		return fmt.Errorf("%w: building the client: %w", ErrCRDRegistration, err)
	}
	for _, want := range CRDs() {
		label := ownSchemaVersionLabel
		if want.Spec.Group == CiliumGroup {
			label = ciliumSchemaVersionLabel
		}
		if err := registerCRD(ctx, crds, want, label, want.Labels[label]); err != nil {
			return err
		}
	}
	return nil
}

// CRDs returns the definitions RegisterCRDs installs, in its order: what
// an administrator installs instead when the agents may not write CRDs.
func CRDs() []*apiextensionsv1.CustomResourceDefinition {
	return []*apiextensionsv1.CustomResourceDefinition{CiliumIdentityCRD(), IdentityNodeCRD(), IdentityLeaseCRD()}
}

func registerCRD(ctx context.Context, crds *crdclient.Client, want *apiextensionsv1.CustomResourceDefinition, label, version string) error {
	name := want.Name
	fail := func(verb string, err error) error {
		if apierrors.IsForbidden(err) {
			return fmt.Errorf("%w: %s: %s refused (the role needs %q on customresourcedefinitions.apiextensions.k8s.io, or the CRD must be installed by someone who has it): %w",
				ErrCRDRegistration, name, verb, verb, err)
		}
		return fmt.Errorf("%w: %s: %s: %w", ErrCRDRegistration, name, verb, err)
	}
	for attempt := 0; ; attempt++ {
		cur, err := crds.Get(ctx, name)
		switch {
		case apierrors.IsNotFound(err):
			_, err = crds.Create(ctx, want)
			if apierrors.IsAlreadyExists(err) && attempt < 5 {
				continue // another node created it meanwhile: check it
			}
			if err != nil {
				return fail("create", err)
			}
		case err != nil:
			return fail("get", err)
		case !olderVersion(cur.Labels[label], version) && cur.Spec.Versions != nil:
			return waitEstablished(ctx, crds, cur, fail)
		default:
			upd := cur.DeepCopy()
			if upd.Labels == nil {
				upd.Labels = map[string]string{}
			}
			upd.Labels[label] = version
			upd.Spec = want.Spec
			// An older definition may carry it over; v1 CRDs must not.
			upd.Spec.PreserveUnknownFields = false
			_, err = crds.Update(ctx, upd)
			if apierrors.IsConflict(err) && attempt < 5 {
				continue
			}
			if err != nil {
				return fail("update", err)
			}
		}
		cur, err = crds.Get(ctx, name)
		if err != nil {
			return fail("get", err)
		}
		return waitEstablished(ctx, crds, cur, fail)
	}
}

// waitEstablished waits until the API server serves the CRD.
func waitEstablished(ctx context.Context, crds *crdclient.Client, cur *apiextensionsv1.CustomResourceDefinition, fail func(string, error) error) error {
	ctx, cancel := context.WithTimeout(ctx, crdEstablishTimeout)
	defer cancel()
	for {
		for _, c := range cur.Status.Conditions {
			switch {
			case c.Type == apiextensionsv1.Established && c.Status == apiextensionsv1.ConditionTrue:
				return nil
			case c.Type == apiextensionsv1.NamesAccepted && c.Status == apiextensionsv1.ConditionFalse:
				return fmt.Errorf("%w: %s: names not accepted: %s", ErrCRDRegistration, cur.Name, c.Message)
			}
		}
		t := time.NewTimer(100 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("%w: %s: not established: %w", ErrCRDRegistration, cur.Name, ctx.Err())
		case <-t.C:
		}
		var err error
		if cur, err = crds.Get(ctx, cur.Name); err != nil {
			return fail("get", err)
		}
	}
}

// olderVersion reports whether the dotted version have is missing,
// unreadable or older than want.
func olderVersion(have, want string) bool {
	h, okh := parseVersion(have)
	w, _ := parseVersion(want)
	if !okh {
		return true
	}
	for i := range 3 {
		if h[i] != w[i] {
			return h[i] < w[i]
		}
	}
	return false
}

func parseVersion(s string) ([3]int, bool) {
	var v [3]int
	parts := strings.Split(strings.TrimPrefix(s, "v"), ".")
	if len(parts) == 0 || len(parts) > 3 {
		return v, false
	}
	for i, p := range parts {
		n, err := strconv.Atoi(p)
		if err != nil || n < 0 {
			return v, false
		}
		v[i] = n
	}
	return v, true
}
