// Package globalstore is the contract between the allocator and the stores
// of cluster-wide identities, in the way database/sql/driver is the
// contract between database/sql and its drivers: a driver (the etcd store
// in cells/allocator/etcdstore) implements Backend and reports what it
// learns to the allocator's Events; a read-only source of other clusters'
// identities (cells/allocator/clustermesh) implements Remote. The allocator
// consumes both and imports no driver; drivers import this package, never
// the allocator.
//
// The allocator counts this node's references itself and calls a Backend
// only for the first reference and the last release of a label set, so the
// reference counts of this node live in the allocator alone. The record of
// which label sets this node references lives there too: a Backend that
// must write them again (after a lost lease, say) reads it through
// References, and keeps what it needs of each (the revision it wrote the
// reference at) in the Reference itself.
//
// A store is an ordinary cell: it registers its own start and stop hooks
// and jobs. It reports the changes of its cache (every identity that
// appears or disappears, and Synced once after its first complete
// listing) to the Sink of its mode, and reads References from the same
// Sink, which the allocator binds when it is built (see Sinks). An
// identity that Allocate created need not be reported: the allocator
// reports it from Allocate's result. The store's hooks run before the
// allocator's start and after its stop.
//
// Each driver cell offers its Backend as a Driver in the DriverGroup value
// group, named by the identity.AllocationMode it serves; the allocator uses
// the one of the configured --identity-allocation-mode. The flags every
// store shares are Config's, which the allocator cell registers.
package globalstore

import (
	"context"
	"errors"
	"sync/atomic"

	"github.com/cilium/hive/cell"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// Backend stores cluster-wide identities in a store the nodes share.
type Backend interface {
	// Allocate returns the numeric identity of the label set, creating it
	// or adopting the one another node created, and writes this node's
	// reference. allocated is true when the identity was created. The
	// allocator calls it once per label set until the matching Release.
	//
	// Allocate calls record exactly once when it returns no error, and
	// never otherwise, with the reference it wrote, before anything that
	// rewrites this node's references (the backend's repair of a lost
	// lease, say) can run: record adds it to the References the backend
	// was started with, so that no written reference is ever missing
	// from them.
	Allocate(ctx context.Context, lbls labels.Labels, record func(*Reference)) (id identity.NumericIdentity, allocated bool, err error)

	// Adopt is Allocate for a label set the store already holds: it
	// never creates. It returns the identity every node uses for the
	// label set and writes this node's reference as Allocate does
	// (calling record once when it returns no error), or an error
	// wrapping ErrNoIdentity when the store holds no identity for it, as
	// far as the store's cache shows. Agents whose identities an identity
	// manager creates (--identity-management-mode=operator) adopt them.
	Adopt(ctx context.Context, lbls labels.Labels, record func(*Reference)) (identity.NumericIdentity, error)

	// Release removes this node's reference. The allocator has removed
	// ref from its References before the call; ref is the one Allocate
	// recorded, and its token is whatever the backend last stored in it,
	// including a rewrite made after the allocator removed it.
	Release(ctx context.Context, ref *Reference) error

	// LookupByID and LookupByLabels consult the backend's cache of all
	// global identities, without a request.
	LookupByID(id identity.NumericIdentity) (labels.Labels, bool)
	LookupByLabels(lbls labels.Labels) (identity.NumericIdentity, bool)
}

// DriverGroup is the hive value group of the Drivers the allocator picks
// its Backend from.
const DriverGroup = "globalstore-drivers"

// Driver is a store of global identities as its cell offers it to the
// allocator: the Backend serving Mode. A nil Backend means the store cannot
// serve (the etcd store without an etcd client, or a store of another mode
// than the configured one): the allocator then serves local identities
// only, as without any store.
type Driver struct {
	Mode    identity.AllocationMode
	Backend Backend
}

// DriverOut adds a Driver to DriverGroup. Return it from a constructor
// given to cell.Provide.
type DriverOut struct {
	cell.Out

	Driver Driver `group:"globalstore-drivers"`
}

// NewDriver returns the DriverOut of backend for mode. A store that cannot
// serve passes a nil interface, not a nil pointer of its type.
func NewDriver(mode identity.AllocationMode, backend Backend) DriverOut {
	return DriverOut{Driver: Driver{Mode: mode, Backend: backend}}
}

// Reference is one label set this node references in the global store, as
// the allocator records it from Allocate until Release. ID and Labels never
// change. The token is the backend's own: the etcd store keeps in it the
// revision at which it last wrote the reference key, so that a release
// deletes only that write.
type Reference struct {
	ID     identity.NumericIdentity
	Labels labels.Labels
	token  atomic.Int64
}

// NewReference returns the reference to id for lbls, with the backend's
// token.
func NewReference(id identity.NumericIdentity, lbls labels.Labels, token int64) *Reference {
	r := &Reference{ID: id, Labels: lbls}
	r.token.Store(token)
	return r
}

// Token returns what the backend last stored with SetToken.
func (r *Reference) Token() int64 { return r.token.Load() }

// SetToken stores the backend's token, when it wrote the reference again.
func (r *Reference) SetToken(token int64) { r.token.Store(token) }

// References is the allocator's record of this node's references, which a
// backend reads. Its methods, like Allocate's record, take the allocator's
// lock briefly; the allocator never calls the backend while holding it, so
// a backend may call them while it holds locks of its own.
type References interface {
	// Each calls fn for every reference recorded when Each was called,
	// outside the allocator's lock.
	Each(fn func(*Reference))
	// ByID returns the reference to id, or nil when none is recorded.
	ByID(id identity.NumericIdentity) *Reference
}

// Remote is a read-only source of other clusters' identities. It never
// allocates or releases; the allocator serves its identities to lookups
// and reports them with the source "remote". Like a store, it is a cell
// with hooks and jobs of its own: it reports the identities it follows to
// Sinks.Remote as they appear and disappear (Synced is not called: remote
// clusters come and go), and its stop does not report the deletion of
// what it reported.
type Remote interface {
	LookupByID(id identity.NumericIdentity) (labels.Labels, bool)
	LookupByLabels(lbls labels.Labels) (identity.NumericIdentity, bool)
}

// Events receives the changes of a store's cache of identities.
type Events interface {
	Upsert(id identity.NumericIdentity, lbls labels.Labels)
	Delete(id identity.NumericIdentity, lbls labels.Labels)
	Synced()
}

// SpaceWarnRatio is the fill of this cluster's global ID range from which
// the allocator's identity-space health scope says it is degraded (at level
// OK: the node still serves) and logs a warning, and from which the CRD
// store's walks take the IDs of identities the collector would delete
// rather than step over them: at 90% a churn that outruns the garbage
// collection has a tenth of the range left to run on, time to act before
// allocations are refused.
const SpaceWarnRatio = 0.9

// Errors of global stores. Errors returned by a Backend wrap these.
var (
	// ErrSpaceExhausted: every ID of this cluster's range is in use.
	ErrSpaceExhausted = errors.New("out of global identity space")
	// ErrConflict: other writers kept winning the races for the label set
	// or its candidate IDs until the attempts ran out.
	ErrConflict = errors.New("global identity allocation kept conflicting with other writers")
	// ErrUnavailable: the store (etcd, or the Kubernetes API server) did not
	// answer, or refused the request.
	ErrUnavailable = errors.New("global identity store unavailable")
	// ErrNoIdentity: the store holds no identity for the label set, and
	// the caller may not create one (Adopt).
	ErrNoIdentity = errors.New("no global identity for the label set in the store")
)

// GCResult is what one garbage collection of a global store did. The etcd
// store deletes unreferenced master keys in one pass and counts Deleted
// and Skipped only; the CRD store marks before it deletes and counts them
// all.
type GCResult struct {
	// Marked counts identities that got the heartbeat mark; Deleted those
	// deleted; Skipped the deletes a precondition refused (the identity
	// changed, went or was referenced since it was listed: a use won).
	Marked, Deleted, Skipped int
	// KeptUsed counts unreserved identities a live IdentityNode (or this
	// node) uses, or a CiliumEndpoint or CiliumEndpointSlice names;
	// KeptFenced unused ones that the fence keeps.
	KeptUsed, KeptFenced int
	// Unmarked counts marks removed from fenced identities and from
	// identities only Cilium's endpoint objects name.
	Unmarked int
	// Deferred counts marked identities past the timeout left to the next
	// run because a walk announced it stepped over them.
	Deferred int
	// NodesDeleted counts IdentityNode objects deleted a lease after
	// their lease ended.
	NodesDeleted int
}
