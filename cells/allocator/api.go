package allocator

import (
	"context"
	"errors"
	"fmt"

	"github.com/cilium/hive/cell"
	"github.com/cilium/stream"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// Allocator hands out numeric identities for label sets. Reserved label sets
// resolve to their fixed identity, local scopes are served from memory, and
// global label sets go to the store of global identities (etcd, or the
// Kubernetes API server in crd mode). Every method is safe for concurrent
// use.
type Allocator interface {
	// Allocate returns the identity of lbls and takes a reference on it.
	// allocated is true when the identity did not exist before. Options
	// may ask for an old numeric ID (honoured for local scopes when it is
	// free, even if withheld). A local-scope allocation waits until
	// restoration has finished (see WaitForRestoration), bounded by ctx
	// and --identity-allocation-timeout, unless it is restoration's own
	// (AsRestored, or a ctx from Restoring). A start hook must therefore
	// not allocate a local identity unless its cell depends on the
	// restoration (*restoration.Restorer), which puts its hook after
	// restoration's: otherwise it waits for a hook that runs after it.
	// Allocate from a job instead.
	Allocate(ctx context.Context, lbls labels.Labels, opts ...AllocateOption) (id *identity.Identity, allocated bool, err error)

	// AllocateBatch allocates every request and notifies the identity
	// handlers of all new identities in one batch. A failed request does
	// not stop the others; its error is in its Result.
	AllocateBatch(ctx context.Context, reqs []Request) []Result

	// Release drops one reference on the identity. released is true when
	// it was the last one and the identity is gone. Releasing a reserved
	// identity is a no-op.
	Release(ctx context.Context, id *identity.Identity) (released bool, err error)

	// LookupByLabels returns the identity of lbls without taking a
	// reference, or nil.
	LookupByLabels(lbls labels.Labels) *identity.Identity

	// LookupByID returns the identity with this number without taking a
	// reference, or nil. It also finds reserved and remote identities.
	LookupByID(id identity.NumericIdentity) *identity.Identity

	// List returns every identity the allocator knows (reserved, local,
	// global and restored), with its reference count on this node.
	List() []Entry

	// LocalIdentities returns the identities of both local scopes, for
	// the checkpoint.
	LocalIdentities() []*identity.Identity

	// Withhold keeps local numeric IDs from being handed out unless they
	// are explicitly requested. Unwithhold lifts that.
	Withhold(ids []identity.NumericIdentity)
	Unwithhold(ids []identity.NumericIdentity)
	// Withheld returns the withheld local IDs in ascending order.
	Withheld() []identity.NumericIdentity

	// WaitForRestoration returns once the restoration registered with
	// NewRestoration has finished (at once in a hive without one), or
	// with ctx's error. Once restoration has finished it returns nil even
	// if ctx has ended. The checkpoint waits for it before writing, the
	// ipcache before writing or pruning the datapath map.
	WaitForRestoration(ctx context.Context) error

	// WaitForInitialGlobalIdentities returns once the global identities
	// were listed from the global store (at once without one), or with
	// the context's error.
	WaitForInitialGlobalIdentities(ctx context.Context) error

	// Observable emits every identity add and delete: first the current
	// identities as upserts, then one ChangeSync, then live changes.
	stream.Observable[Change]
}

// AllocateOption modifies one allocation.
type AllocateOption func(*allocateOptions)

type allocateOptions struct {
	oldID     identity.NumericIdentity
	restored  bool
	adoptOnly bool
}

// WithOldID asks for a specific numeric ID, as restoration does to keep a
// local identity's number across restarts. The request is honoured when the
// ID is in the scope of the labels and free; otherwise another ID is given.
func WithOldID(id identity.NumericIdentity) AllocateOption {
	return func(o *allocateOptions) { o.oldID = id }
}

// AsRestored marks the reference as taken by restoration, which shows in
// the identities table's Source column until a non-restored reference is
// taken. Such an allocation does not wait for restoration to finish.
func AsRestored() AllocateOption {
	return func(o *allocateOptions) { o.restored = true }
}

// AdoptOnly makes a global label set's allocation take the identity the
// global store holds and never create one: another writer creates them
// (an identity manager, with --identity-management-mode=operator). When
// the store's cache shows none, the allocation fails at once, without a
// request, with an error wrapping globalstore.ErrNoIdentity. Node-local
// and reserved label sets are allocated as without it.
func AdoptOnly() AllocateOption {
	return func(o *allocateOptions) { o.adoptOnly = true }
}

// Request is one allocation of a batch.
type Request struct {
	Labels labels.Labels
	OldID  identity.NumericIdentity
	// Restored marks the reference as taken by restoration (AsRestored).
	Restored bool
	// AdoptOnly takes the global store's identity without creating one
	// (AdoptOnly).
	AdoptOnly bool
}

// Result is the outcome of one Request.
type Result struct {
	Identity  *identity.Identity
	Allocated bool
	Err       error
}

// Entry is an identity with what this node knows of it.
type Entry struct {
	Identity *identity.Identity `json:"identity"`
	Source   Source             `json:"source"`
	// RefCount is the number of references held on this node (0 for
	// reserved identities and for global identities other nodes hold).
	RefCount int `json:"ref-count"`

	ref *refEntry
}

// Source tells where an identity came from.
type Source string

// Sources of identities.
const (
	SourceReserved Source = "reserved"
	SourceLocal    Source = "local"
	SourceGlobal   Source = "global"
	SourceRestored Source = "restored"
	SourceRemote   Source = "remote"
)

// ChangeKind is the kind of an identity change.
type ChangeKind int

const (
	// ChangeUpsert says the identity exists.
	ChangeUpsert ChangeKind = iota
	// ChangeDelete says the identity is gone.
	ChangeDelete
	// ChangeSync marks the end of the initial replay.
	ChangeSync
)

func (k ChangeKind) String() string {
	switch k {
	case ChangeUpsert:
		return "upsert"
	case ChangeDelete:
		return "delete"
	case ChangeSync:
		return "sync"
	}
	return fmt.Sprintf("kind(%d)", int(k))
}

// Change is one event of the Observable. ID and Labels are empty for
// ChangeSync.
type Change struct {
	Kind   ChangeKind
	ID     identity.NumericIdentity
	Labels labels.Labels
}

// IdentityMap maps numeric identities to their labels.
type IdentityMap map[identity.NumericIdentity]labels.Labels

// Handler receives identity changes in batches: one call per batch, and an
// add and a delete of the same ID within one batch cancel out. Calls are
// serialized.
type Handler interface {
	UpdateIdentities(added, deleted IdentityMap)
}

// HandlerFunc adapts a function to Handler.
type HandlerFunc func(added, deleted IdentityMap)

// UpdateIdentities calls f.
func (f HandlerFunc) UpdateIdentities(added, deleted IdentityMap) { f(added, deleted) }

// HandlerOut registers a Handler from a constructor of another cell.
type HandlerOut struct {
	cell.Out
	Handler Handler `group:"identity-handlers"`
}

// NewHandler returns a HandlerOut, for cell.Provide.
func NewHandler(h Handler) HandlerOut { return HandlerOut{Handler: h} }

// Errors of the allocator. Errors returned by the allocator wrap these.
var (
	// ErrLocalSpaceExhausted: every ID of a local scope is in use.
	ErrLocalSpaceExhausted = errors.New("out of local identity space")
	// ErrNoGlobalBackend: a global label set needs a store of global
	// identities (etcd, or a Kubernetes API server in crd mode), and the
	// hive has none.
	ErrNoGlobalBackend = errors.New("global identities need a global store: none is configured (kvstore mode: the kvstore and etcdstore cells; crd mode: the k8sclient and crdstore cells)")
	// ErrUnknownIdentity: release of an identity this node does not hold.
	ErrUnknownIdentity = errors.New("identity not held by this node")
	// ErrInvalidLabels: the label set is refused (wraps the labels error).
	ErrInvalidLabels = errors.New("invalid label set")
)
