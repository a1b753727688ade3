package storetest

import (
	"sync"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// Refs is this node's record of references, as the allocator keeps it: a
// store reads it through globalstore.References, and a test records what
// Allocate gives and removes what it releases.
type Refs struct {
	mu   sync.Mutex
	byID map[identity.NumericIdentity]*globalstore.Reference
}

var _ globalstore.References = (*Refs)(nil)

// NewRefs returns an empty record.
func NewRefs() *Refs {
	return &Refs{byID: map[identity.NumericIdentity]*globalstore.Reference{}}
}

// Record adds ref; pass it to Allocate as its record.
func (r *Refs) Record(ref *globalstore.Reference) {
	r.mu.Lock()
	r.byID[ref.ID] = ref
	r.mu.Unlock()
}

// Remove removes the reference to id and returns it, for Release; nil
// when none is recorded.
func (r *Refs) Remove(id identity.NumericIdentity) *globalstore.Reference {
	r.mu.Lock()
	defer r.mu.Unlock()
	ref := r.byID[id]
	delete(r.byID, id)
	return ref
}

// Len is the number of references recorded.
func (r *Refs) Len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.byID)
}

// Each implements globalstore.References.
func (r *Refs) Each(fn func(*globalstore.Reference)) {
	r.mu.Lock()
	refs := make([]*globalstore.Reference, 0, len(r.byID))
	for _, ref := range r.byID {
		refs = append(refs, ref)
	}
	r.mu.Unlock()
	for _, ref := range refs {
		fn(ref)
	}
}

// ByID implements globalstore.References.
func (r *Refs) ByID(id identity.NumericIdentity) *globalstore.Reference {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.byID[id]
}

// Events records what a store reports: the identities its cache holds,
// and whether its first listing completed.
type Events struct {
	mu      sync.Mutex
	ids     map[identity.NumericIdentity]labels.Labels
	deletes map[identity.NumericIdentity]int
	synced  chan struct{}
	once    sync.Once
}

var _ globalstore.Events = (*Events)(nil)

// NewEvents returns a record of nothing.
func NewEvents() *Events {
	return &Events{
		ids:     map[identity.NumericIdentity]labels.Labels{},
		deletes: map[identity.NumericIdentity]int{},
		synced:  make(chan struct{}),
	}
}

// Upsert implements globalstore.Events.
func (e *Events) Upsert(id identity.NumericIdentity, lbls labels.Labels) {
	e.mu.Lock()
	e.ids[id] = lbls
	e.mu.Unlock()
}

// Delete implements globalstore.Events.
func (e *Events) Delete(id identity.NumericIdentity, _ labels.Labels) {
	e.mu.Lock()
	delete(e.ids, id)
	e.deletes[id]++
	e.mu.Unlock()
}

// Synced implements globalstore.Events.
func (e *Events) Synced() { e.once.Do(func() { close(e.synced) }) }

// Listed is closed once the store reported its first complete listing.
func (e *Events) Listed() <-chan struct{} { return e.synced }

// Get returns the labels reported for id, and whether id is reported.
func (e *Events) Get(id identity.NumericIdentity) (labels.Labels, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	l, ok := e.ids[id]
	return l, ok
}

// Deletes is how many times id was reported deleted.
func (e *Events) Deletes(id identity.NumericIdentity) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.deletes[id]
}
