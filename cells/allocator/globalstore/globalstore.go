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
// reference counts of this node live in the allocator alone.
package globalstore

import (
	"context"
	"errors"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// Backend stores cluster-wide identities in a store the nodes share.
type Backend interface {
	// Allocate returns the numeric identity of the label set, creating it
	// or adopting the one another node created, and records this node's
	// reference. allocated is true when the identity was created. The
	// allocator calls it once per label set until the matching Release.
	Allocate(ctx context.Context, lbls labels.Labels) (id identity.NumericIdentity, allocated bool, err error)

	// Release removes this node's reference on the identity.
	Release(ctx context.Context, id identity.NumericIdentity, lbls labels.Labels) error

	// LookupByID and LookupByLabels consult the backend's cache of all
	// global identities, without a request.
	LookupByID(id identity.NumericIdentity) (labels.Labels, bool)
	LookupByLabels(lbls labels.Labels) (identity.NumericIdentity, bool)

	// Start begins keeping the cache; every identity that appears or
	// disappears is reported to events, and events.Synced is called once
	// after the first complete listing. Stop ends it. An identity that
	// Allocate created need not be reported: the allocator reports it
	// from Allocate's result. The allocator calls Start from its start
	// hook and Stop from its stop hook.
	Start(ctx context.Context, events Events) error
	Stop(ctx context.Context) error
}

// Remote is a read-only source of other clusters' identities. It never
// allocates or releases; the allocator serves its identities to lookups
// and reports them with the source "remote".
type Remote interface {
	LookupByID(id identity.NumericIdentity) (labels.Labels, bool)
	LookupByLabels(lbls labels.Labels) (identity.NumericIdentity, bool)

	// Start begins following the remote clusters; their identities are
	// reported to events as they appear and disappear (Synced is not
	// called: remote clusters come and go). Stop ends it without
	// reporting the deletion of what it reported.
	Start(ctx context.Context, events Events) error
	Stop(ctx context.Context) error
}

// Events receives the changes of a store's cache of identities.
type Events interface {
	Upsert(id identity.NumericIdentity, lbls labels.Labels)
	Delete(id identity.NumericIdentity, lbls labels.Labels)
	Synced()
}

// Errors of global stores. Errors returned by a Backend wrap these.
var (
	// ErrSpaceExhausted: every ID of this cluster's range is in use.
	ErrSpaceExhausted = errors.New("out of global identity space")
	// ErrConflict: other writers kept winning the races for the label set
	// or its candidate IDs until the attempts ran out.
	ErrConflict = errors.New("global identity allocation kept conflicting with other writers")
	// ErrUnavailable: the store did not answer, or refused the request.
	ErrUnavailable = errors.New("kvstore unavailable")
)
