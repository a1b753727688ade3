package migrate

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"

	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// crdEnd is the CRD store: CiliumIdentity objects (docs/crd-store.md). As a
// target it creates objects exactly as the CRD store does, and holds the
// migrated identities in an IdentityNode record of the hold's node.
type crdEnd struct {
	cfg     *rest.Config
	cluster identity.ClusterInfo
	node    string
	lease   time.Duration
	claim   globalstore.NodeClaim
	dyn     dynamic.Interface
	err     error
}

func newCRDEnd(o Options) *crdEnd {
	e := &crdEnd{cfg: o.K8s, cluster: o.Cluster, node: o.HoldNode, lease: o.Hold, claim: globalstore.NewNodeClaim()}
	e.dyn, e.err = dynamic.NewForConfig(o.K8s)
	return e
}

func (e *crdEnd) identities() dynamic.ResourceInterface {
	return e.dyn.Resource(crdstore.CiliumIdentityResource)
}

func (e *crdEnd) list(ctx context.Context) (map[identity.NumericIdentity]*item, []Skipped, error) {
	if e.err != nil {
		return nil, nil, e.err
	}
	items := map[identity.NumericIdentity]*item{}
	var skipped []Skipped
	opts := metav1.ListOptions{Limit: listPage}
	for {
		l, err := e.identities().List(ctx, opts)
		if apierrors.IsNotFound(err) {
			// The CRD is not installed: no identities.
			return items, nil, nil
		}
		if err != nil {
			return nil, nil, err
		}
		for i := range l.Items {
			it, ok := readIdentity(&l.Items[i])
			if !ok {
				skipped = append(skipped, Skipped{Name: l.Items[i].GetName(), Value: it.raw, Reason: "object name is not a numeric ID"})
				continue
			}
			items[it.id] = it
		}
		if opts.Continue = l.GetContinue(); opts.Continue == "" {
			return items, skipped, nil
		}
	}
}

// readIdentity reads a CiliumIdentity with the CRD store's mapping
// (crdstore.ParseIdentityName, crdstore.ParseSecurityLabels). ok is false
// when the name holds no ID.
func readIdentity(u *unstructured.Unstructured) (*item, bool) {
	raw, _, _ := unstructured.NestedFieldNoCopy(u.Object, "security-labels")
	m, _ := raw.(map[string]any)
	it := &item{raw: rawLabels(m), rv: u.GetResourceVersion()}
	_, it.marked = u.GetAnnotations()[crdstore.HeartbeatAnnotation]
	id, err := crdstore.ParseIdentityName(u.GetName())
	if err != nil {
		return it, false
	}
	it.id = id
	obj := new(crdstore.CiliumIdentity)
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, obj); err != nil {
		it.err = fmt.Errorf("object does not decode: %w", err)
		return it, true
	}
	it.obj = obj
	if it.lbls, it.err = crdstore.ParseSecurityLabels(obj.SecurityLabels); it.err == nil {
		it.key = it.lbls.Canonical()
	} else {
		it.err = fmt.Errorf("security-labels: %w", it.err)
	}
	return it, true
}

// rawLabels prints a security-labels map for a report, keys sorted.
func rawLabels(m map[string]any) string {
	var b strings.Builder
	for _, k := range slices.Sorted(maps.Keys(m)) {
		fmt.Fprintf(&b, "%s=%v;", k, m[k])
	}
	return b.String()
}

// identityObject is the CiliumIdentity of id for lbls as the CRD store
// creates it (crdstore.NewIdentityObject).
func identityObject(id identity.NumericIdentity, lbls labels.Labels) (*unstructured.Unstructured, error) {
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(crdstore.NewIdentityObject(id, lbls))
	if err != nil {
		return nil, err
	}
	return &unstructured.Unstructured{Object: m}, nil
}

// prepare installs or updates the CRDs as the CRD store does at start.
func (e *crdEnd) prepare(ctx context.Context) error {
	if e.err != nil {
		return e.err
	}
	return crdstore.RegisterCRDs(ctx, e.cfg)
}

// create creates the object with the CRD store's field manager: the store
// ranks it among the label set's objects as one it created itself.
func (e *crdEnd) create(ctx context.Context, id identity.NumericIdentity, lbls labels.Labels) (*item, error) {
	obj, err := identityObject(id, lbls)
	if err != nil {
		return nil, err
	}
	_, err = e.identities().Create(ctx, obj, metav1.CreateOptions{FieldManager: crdstore.FieldManager})
	if err == nil {
		return nil, nil
	}
	if !apierrors.IsAlreadyExists(err) {
		return nil, err
	}
	u, err := e.identities().Get(ctx, id.String(), metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("reading the object that holds %d: %w", id, err)
	}
	it, _ := readIdentity(u)
	return it, nil
}

// unmark removes the heartbeat mark, as the CRD store does when it adopts
// or passes a marked identity: with the listed resourceVersion as
// precondition. An object changed since is left as it is: the hold keeps
// it either way.
func (e *crdEnd) unmark(ctx context.Context, it *item) error {
	patch := fmt.Appendf(nil, `{"metadata":{"resourceVersion":%q,"annotations":{%q:null}}}`, it.rv, crdstore.HeartbeatAnnotation)
	_, err := e.identities().Patch(ctx, it.id.String(), types.MergePatchType, patch, metav1.PatchOptions{})
	if apierrors.IsConflict(err) || apierrors.IsNotFound(err) {
		return nil
	}
	return err
}

// hold writes the IdentityNode of the hold's node listing every ID, with a
// lease of the hold's duration: the collector counts the IDs of a record
// whose lease has not ended as used (docs/crd-store.md, "Garbage
// collection"), and deletes the record a lease after it ended.
func (e *crdEnd) hold(ctx context.Context, h holding) error {
	list := make([]uint32, 0, len(h.ids))
	for _, id := range sortedIDs(h.ids) {
		list = append(list, uint32(id))
	}
	nodes := e.dyn.Resource(crdstore.IdentityNodeResource)
	for attempt := 0; ; attempt++ {
		// The record in the store's own type, so that it is what a node
		// writes.
		spec, err := runtime.DefaultUnstructuredConverter.ToUnstructured(&crdstore.IdentityNodeSpec{
			Identities:           list,
			RenewTime:            metav1.NewMicroTime(time.Now()),
			LeaseDurationSeconds: int32(e.lease.Seconds()),
			Holder:               &e.claim,
		})
		if err != nil {
			return err
		}
		cur, err := nodes.Get(ctx, e.node, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			u := &unstructured.Unstructured{Object: map[string]any{
				"apiVersion": crdstore.IdentityGroup + "/" + crdstore.IdentityVersion,
				"kind":       "IdentityNode",
				"metadata":   map[string]any{"name": e.node},
				"spec":       spec,
			}}
			_, err = nodes.Create(ctx, u, metav1.CreateOptions{})
		case err == nil:
			cur.Object["spec"] = spec
			_, err = nodes.Update(ctx, cur, metav1.UpdateOptions{})
		}
		if err == nil {
			return nil
		}
		if (apierrors.IsConflict(err) || apierrors.IsAlreadyExists(err)) && attempt < 5 {
			continue
		}
		return fmt.Errorf("writing IdentityNode %s: %w", e.node, err)
	}
}

// skip: the CRD store takes every valid label set.
func (e *crdEnd) skip(labels.Labels, string) string { return "" }

// choose is the CRD store's choice among a label set's objects
// (crdstore.PickIdentity).
func (e *crdEnd) choose(its []*item) identity.NumericIdentity {
	objs := make([]*crdstore.CiliumIdentity, 0, len(its))
	for _, it := range its {
		if it.obj != nil {
			objs = append(objs, it.obj)
		}
	}
	pick, err := crdstore.PickIdentity(e.cluster, objs)
	if err != nil || pick == nil {
		return identity.InvalidIdentity
	}
	id, err := crdstore.ParseIdentityName(pick.Name)
	if err != nil {
		return identity.InvalidIdentity
	}
	return id
}
