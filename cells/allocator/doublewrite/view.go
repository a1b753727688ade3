package doublewrite

import (
	"maps"
	"sync"
	"sync/atomic"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// view follows one store's cache through the events it reports: the IDs of
// this cluster's range and their label sets' canonical strings, for the
// comparison of the two stores. The read store's events go on to the
// allocator (next); the write-only store's stop here.
type view struct {
	cluster identity.ClusterInfo
	next    globalstore.Events

	mu     sync.RWMutex
	ids    map[identity.NumericIdentity]string
	synced atomic.Bool
}

func newView(cluster identity.ClusterInfo) *view {
	return &view{cluster: cluster, ids: map[identity.NumericIdentity]string{}}
}

func (v *view) inRange(id identity.NumericIdentity) bool {
	return id >= v.cluster.MinID() && id <= v.cluster.MaxID()
}

func (v *view) Upsert(id identity.NumericIdentity, lbls labels.Labels) {
	if v.inRange(id) {
		key := lbls.Canonical()
		v.mu.Lock()
		v.ids[id] = key
		v.mu.Unlock()
	}
	if v.next != nil {
		v.next.Upsert(id, lbls)
	}
}

func (v *view) Delete(id identity.NumericIdentity, lbls labels.Labels) {
	if v.inRange(id) {
		v.mu.Lock()
		delete(v.ids, id)
		v.mu.Unlock()
	}
	if v.next != nil {
		v.next.Delete(id, lbls)
	}
}

func (v *view) Synced() {
	v.synced.Store(true)
	if v.next != nil {
		v.next.Synced()
	}
}

// snapshot copies the IDs.
func (v *view) snapshot() map[identity.NumericIdentity]string {
	v.mu.RLock()
	defer v.mu.RUnlock()
	return maps.Clone(v.ids)
}

// note records an identity the store holds without its cache reporting
// it: one this node's allocation created there.
func (v *view) note(id identity.NumericIdentity, lbls labels.Labels) {
	if !v.inRange(id) {
		return
	}
	key := lbls.Canonical()
	v.mu.Lock()
	v.ids[id] = key
	v.mu.Unlock()
}
