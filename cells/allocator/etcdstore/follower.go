package etcdstore

import (
	"context"
	"log/slog"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// Source is what a Follower reads through: a kvstore client, which may not
// be connected yet (Client returns nil until it is).
type Source interface {
	Client() *clientv3.Client
	RequestTimeout() time.Duration
}

// FollowerHooks tell a Follower's owner what it sees. Every hook is
// optional.
type FollowerHooks struct {
	// Validate rejects an identity, which is then skipped, logged and
	// counted like a master key that does not parse.
	Validate func(id identity.NumericIdentity, lbls labels.Labels) error
	// Events receives every identity that appears or disappears, in
	// order, and Synced after the first complete listing.
	Events globalstore.Events
	// Listed runs after every complete listing, Failed when a listing or
	// a watch fails.
	Listed func()
	Failed func(error)
}

// Follower is a read-only list+watch cache of the global identities in an
// etcd, with the key layout the Store writes: the view the cluster mesh
// keeps of a remote cluster. It never writes.
type Follower struct{ cache masterCache }

// NewFollower returns a Follower of the etcd behind src. When prev is not
// nil the new Follower starts with prev's identities, and its first listing
// reports only what differs from them: a reconnection to the same cluster
// then does not withdraw and re-add every identity.
func NewFollower(log *slog.Logger, src Source, what string, hooks FollowerHooks, prev *Follower) *Follower {
	f := &Follower{}
	f.cache = newMasterCache(log, src, what, cacheHooks{
		validate: hooks.Validate,
		emit:     emitTo(hooks.Events),
		listed:   hooks.Listed,
		failed:   hooks.Failed,
	})
	if hooks.Events != nil {
		f.cache.hooks.synced = hooks.Events.Synced
	}
	if prev != nil {
		prev.cache.cacheMu.RLock()
		for id, e := range prev.cache.byID {
			f.cache.byID[id] = e
			f.cache.byKey[e.key] = id
		}
		prev.cache.cacheMu.RUnlock()
	}
	return f
}

// emitTo turns the cache's changes into events.
func emitTo(events globalstore.Events) func([]change) {
	if events == nil {
		return nil
	}
	return func(changes []change) {
		for _, c := range changes {
			if c.upsert {
				events.Upsert(c.id, c.lbls)
			} else {
				events.Delete(c.id, c.lbls)
			}
		}
	}
}

// Run keeps the cache until ctx ends: it lists at one revision, watches
// from the next, and lists again when the watch breaks, falls behind a
// compaction or Relist asks for it.
func (f *Follower) Run(ctx context.Context) { f.cache.cacheLoop(ctx) }

// Relist makes Run list again, reporting only the differences.
func (f *Follower) Relist() { f.cache.requestRelist() }

// Clear empties the cache, reporting the deletion of every identity.
func (f *Follower) Clear() { f.cache.clear() }

// LookupByID returns the labels of a cached identity.
func (f *Follower) LookupByID(id identity.NumericIdentity) (labels.Labels, bool) {
	return f.cache.lookupLabels(id)
}

// LookupByLabels returns the ID of a cached label set.
func (f *Follower) LookupByLabels(lbls labels.Labels) (identity.NumericIdentity, bool) {
	return f.cache.cachedID(lbls.Canonical())
}

// Synced reports whether the first listing completed.
func (f *Follower) Synced() bool { return f.cache.Synced() }

// Counts returns the number of cached identities and of rejected master
// keys now in the etcd; RejectedTotal counts every rejection since the
// Follower was made.
func (f *Follower) Counts() (cached, rejected int) { return f.cache.counts() }

// RejectedTotal returns the number of master keys rejected so far.
func (f *Follower) RejectedTotal() uint64 { return f.cache.rejectedTotal.Load() }
