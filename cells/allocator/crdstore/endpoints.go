package crdstore

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"

	"github.com/cilium/hive/cell"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/identity"
)

// Cilium's agents do not write IdentityNode records: the collector learns
// which identities they use from the objects Cilium's own operator reads
// for that, CiliumEndpoint (one per endpoint, status.identity.id) and
// CiliumEndpointSlice (endpoints of one namespace batched, endpoints[].id).
// Only the collector lists them, at each run, as it lists IdentityNode
// records: no node watches them.

// endpointSource is one kind of Cilium object that names identities in use.
type endpointSource struct {
	kind, resource string
	client         func(*Store) *rest.RESTClient
	// ids decodes one page: the IDs its objects name and the continue
	// token.
	ids func(body []byte) ([]int64, string, error)
}

var endpointSources = []endpointSource{
	{
		kind: "CiliumEndpoint", resource: CiliumEndpointResource.Resource,
		client: func(s *Store) *rest.RESTClient { return s.ciliumClient },
		ids: func(body []byte) ([]int64, string, error) {
			var list struct {
				Metadata metav1.ListMeta `json:"metadata"`
				Items    []struct {
					Status struct {
						Identity *struct {
							ID int64 `json:"id"`
						} `json:"identity"`
					} `json:"status"`
				} `json:"items"`
			}
			if err := json.Unmarshal(body, &list); err != nil {
				return nil, "", err
			}
			out := make([]int64, 0, len(list.Items))
			for _, it := range list.Items {
				if it.Status.Identity != nil {
					out = append(out, it.Status.Identity.ID)
				}
			}
			return out, list.Metadata.Continue, nil
		},
	},
	{
		kind: "CiliumEndpointSlice", resource: CiliumEndpointSliceResource.Resource,
		client: func(s *Store) *rest.RESTClient { return s.sliceClient },
		ids: func(body []byte) ([]int64, string, error) {
			var list struct {
				Metadata metav1.ListMeta `json:"metadata"`
				Items    []struct {
					Endpoints []struct {
						ID int64 `json:"id"`
					} `json:"endpoints"`
				} `json:"items"`
			}
			if err := json.Unmarshal(body, &list); err != nil {
				return nil, "", err
			}
			var out []int64
			for _, it := range list.Items {
				for _, ep := range it.Endpoints {
					out = append(out, ep.ID)
				}
			}
			return out, list.Metadata.Continue, nil
		},
	},
}

// listEndpointIdentities returns the identities that the cluster's
// CiliumEndpoint and CiliumEndpointSlice objects name. A kind the API
// server does not serve (its CRD is not installed: no Cilium agent writes
// it) is left out, and said once in the log and in the health of
// identity-gc-endpoints. Any other failure fails the listing: the run must
// not delete on partial knowledge.
func (s *Store) listEndpointIdentities(ctx context.Context) (map[identity.NumericIdentity]struct{}, error) {
	named := map[identity.NumericIdentity]struct{}{}
	served := make([]bool, len(endpointSources))
	for i, src := range endpointSources {
		ok, err := s.listEndpointSource(ctx, src, named)
		if err != nil {
			return nil, err
		}
		served[i] = ok
	}
	s.gc.endpoints.update(s.log, served)
	return named, nil
}

// listEndpointSource adds to named the IDs src's objects name, in pages as
// listGCNodes lists; false when the API server does not serve src.
func (s *Store) listEndpointSource(ctx context.Context, src endpointSource, named map[identity.NumericIdentity]struct{}) (bool, error) {
	found := map[identity.NumericIdentity]struct{}{}
	opts := metav1.ListOptions{Limit: s.gc.pageSize}
	for {
		body, err := src.client(s).Get().Resource(src.resource).VersionedParams(&opts, metav1.ParameterCodec).DoRaw(ctx)
		switch {
		case apierrors.IsResourceExpired(err) && opts.Continue != "":
			found, opts = map[identity.NumericIdentity]struct{}{}, metav1.ListOptions{Limit: s.gc.pageSize}
			continue
		case apierrors.IsNotFound(err) && opts.Continue == "":
			return false, nil
		case apierrors.IsForbidden(err):
			return false, fmt.Errorf("%w: listing %s objects refused (the role needs list on %s.%s), so no identity is deleted: %w",
				globalstore.ErrUnavailable, src.kind, src.resource, CiliumGroup, err)
		case err != nil:
			return false, fmt.Errorf("%w: listing %s objects, so no identity is deleted: %w", globalstore.ErrUnavailable, src.kind, err)
		}
		ids, cont, err := src.ids(body)
		if err != nil {
			return false, fmt.Errorf("%w: decoding %s objects, so no identity is deleted: %w", globalstore.ErrUnavailable, src.kind, err)
		}
		for _, id := range ids {
			if id >= int64(s.ids.rng.lo) && id <= int64(s.ids.rng.hi) {
				found[identity.NumericIdentity(id)] = struct{}{}
			}
		}
		if cont == "" {
			for id := range found {
				named[id] = struct{}{}
			}
			return true, nil
		}
		opts.Continue = cont
	}
}

// endpointState is what the collector last learned of the endpoint
// sources: which the API server serves. It tells the log on each change,
// and the health of the identity-gc-endpoints job.
type endpointState struct {
	mu       sync.Mutex
	served   []bool // nil before the first listing
	h        cell.Health
	reported string
}

// attach gives the state its health scope (nil: none) and reports on it.
func (e *endpointState) attach(h cell.Health) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.h, e.reported = h, ""
	e.reportLocked()
}

func (e *endpointState) update(log *slog.Logger, served []bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for i, src := range endpointSources {
		if e.served != nil && e.served[i] == served[i] {
			continue
		}
		if served[i] {
			log.Info("The garbage collection counts the identities "+src.kind+" objects name as used", "resource", src.resource+"."+CiliumGroup)
		} else {
			log.Info("The API server does not serve "+src.kind+" objects (CRD not installed): the garbage collection goes on without them", "resource", src.resource+"."+CiliumGroup)
		}
	}
	e.served = served
	e.reportLocked()
}

// servedKinds reports, by kind, whether the last collection found the API
// server serving it; empty before the first.
func (e *endpointState) servedKinds() map[string]bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.served == nil {
		return nil
	}
	out := map[string]bool{}
	for i, src := range endpointSources {
		out[src.kind] = e.served[i]
	}
	return out
}

func (e *endpointState) reportLocked() {
	if e.h == nil {
		return
	}
	msg := "Not collected yet on this node: CiliumEndpoint and CiliumEndpointSlice objects are read at each collection"
	if e.served != nil {
		var in, out []string
		for i, src := range endpointSources {
			if e.served[i] {
				in = append(in, src.kind)
			} else {
				out = append(out, src.kind)
			}
		}
		switch {
		case len(out) == 0:
			msg = "Identities named by " + strings.Join(in, " and ") + " objects count as used"
		case len(in) == 0:
			msg = strings.Join(out, " and ") + " CRDs not installed: identities count as used by IdentityNode records alone (Cilium agents keep theirs by removing the heartbeat mark)"
		default:
			msg = "Identities named by " + strings.Join(in, " and ") + " objects count as used; " + strings.Join(out, " and ") + " CRD not installed"
		}
	}
	if msg != e.reported {
		e.reported = msg
		e.h.OK(msg)
	}
}
