package crdstore

import (
	"context"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/identity"
)

var _ globalstore.Mirror = (*Store)(nil)

// Mirror implements globalstore.Mirror, for the double-write mode that
// decides identities in etcd (doublewrite-readkvstore): it creates the
// CiliumIdentity of ref's ID for ref's label set when the API server has
// none, removes the heartbeat mark from the one it has, and lists the ID
// in this node's IdentityNode (with the writer's next write), so that the
// collector here sees this node's use as it sees the read store's uses.
// An object of another label set under the ID is never written over: the
// error wraps globalstore.ErrIDTaken and names both label sets. The
// identity stays in this node's record all the same: the collector keeps
// the other label set's object while this node lists the ID, so the ID is
// not reused for a third label set while this node's users hold it.
func (s *Store) Mirror(ctx context.Context, ref *globalstore.Reference) error {
	if s.stopped.Load() || s.refs == nil || s.refs.ByID(ref.ID) != ref {
		return nil // released meanwhile
	}
	s.writer.request(false)
	key := ref.Labels.Canonical()
	e := s.ids.get(ref.ID)
	if e == nil {
		err := s.create(ctx, ref.ID, ref.Labels)
		switch {
		case err == nil:
			return nil
		case !apierrors.IsAlreadyExists(err):
			return fmt.Errorf("%w: creating CiliumIdentity %d for %s: %w", globalstore.ErrUnavailable, ref.ID, key, err)
		}
		// The cache was behind: read what holds the ID.
		var obj CiliumIdentity
		if err := s.ciliumClient.Get().Resource("ciliumidentities").Name(ref.ID.String()).Do(ctx).Into(&obj); err != nil {
			return fmt.Errorf("%w: reading CiliumIdentity %d: %w", globalstore.ErrUnavailable, ref.ID, err)
		}
		parsed, perr := s.ids.parse(&obj)
		if perr != nil {
			return fmt.Errorf("%w: %d is %s on this node; its CiliumIdentity's security-labels are not a label set: %w", globalstore.ErrIDTaken, ref.ID, key, perr)
		}
		e = parsed
	}
	if e.key != key {
		other := e.key
		if other == unparsedKey {
			other = "(security-labels that are not a label set)"
		}
		return fmt.Errorf("%w: %d is %s on this node, %s in its CiliumIdentity", globalstore.ErrIDTaken, ref.ID, key, other)
	}
	if e.obj != nil && e.marked() {
		// The unmark job removes it: the collector's delete, made with
		// the marked version as precondition, then fails.
		s.unmarks.push(ref.ID)
	}
	return nil
}

// newMirror offers the store to the double-write modes
// (cells/allocator/doublewrite).
func newMirror(s *Store) globalstore.MirrorOut {
	if s == nil {
		return globalstore.NewMirror(identity.AllocationModeCRD, nil)
	}
	return globalstore.NewMirror(identity.AllocationModeCRD, s)
}

// Collecting implements globalstore.Collector: this node holds the
// IdentityLease and collects.
func (s *Store) Collecting() bool {
	_, self := s.GCLeader()
	return self
}
