// Package migrate copies the global identities of one of identityd's stores
// into the other, keeping their numeric IDs: the etcd store (Cilium's
// kvstore key layout) to CiliumIdentity objects, or back. It is `identityd
// migrate`, the equivalent of Cilium's `cilium-dbg preflight
// migrate-identity`, extended to both directions.
//
// A run lists both stores, plans, then writes: every source identity whose
// ID is free in the target is created there with its ID; one whose ID the
// target gives another label set (a conflict) gets a new ID, placed as the
// CRD store places a new label set (the first free ID of its probe
// sequence), or the ID the target already has for the label set (of
// several objects, the one the CRD store answers, by its own rule,
// crdstore.PickIdentity; of several master keys, the one other nodes'
// references name, which etcd nodes adopt, etcdstore.ReferencedIDs, else
// the smallest). A label set the target already has at another ID is
// reported and not created twice. The stores' mapping of label sets to
// objects and keys is theirs too (crdstore, etcdstore). The plan depends
// only on what the two stores hold, and each write only creates what is
// absent, so a run that was killed and is started again ends where one
// uninterrupted run ends. The identities it migrated are then held for a
// time (Options.Hold) against the target's garbage collection, which would
// otherwise delete what no node uses yet: in etcd by one reference key per
// label set, naming the ID the plan gives it, on a lease of that TTL, in
// the API server by an IdentityNode record of that lease. docs/guides.md
// has the procedure.
package migrate

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/client-go/rest"

	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/idprobe"
	"github.com/identityd/identityd/labels"
)

// Store names one of the two stores of global identities.
type Store string

// The stores, by the names of --identity-allocation-mode.
const (
	KVStore Store = Store(identity.AllocationModeKVStore)
	CRD     Store = Store(identity.AllocationModeCRD)
)

// DefaultHoldNode is the name the migration holds its identities under:
// the node of its etcd reference keys and the name of its IdentityNode.
const DefaultHoldNode = "identityd-migrate"

// DefaultHold is how long migrated identities are held by default.
const DefaultHold = time.Hour

// MinHold and MaxHold bound Options.Hold: a hold shorter than a minute
// ends before anyone can act on the report; etcd leases and IdentityNode
// leases are int32 seconds, and a hold of weeks would keep unused
// identities far past any rollout.
const (
	MinHold = time.Minute
	MaxHold = 7 * 24 * time.Hour
)

// maxRounds bounds the list-plan-write rounds of one run: a round starts
// again only when another writer took an ID the plan wanted.
const maxRounds = 10

// Options configures a run.
type Options struct {
	From, To Store
	// Cluster gives the ID range: source identities outside it are
	// skipped, new IDs are placed in it.
	Cluster identity.ClusterInfo
	// DryRun plans and reports, and writes nothing.
	DryRun bool
	// Hold is how long the migrated identities are kept from the
	// target's garbage collection; HoldNode names the holder.
	Hold     time.Duration
	HoldNode string
	// Etcd is the client of the etcd store, K8s the config of the API
	// server of the CRD store; both are needed.
	Etcd *clientv3.Client
	K8s  *rest.Config
	Log  *slog.Logger
	// afterWrite, when set, is called after every create (tests).
	afterWrite func()
}

// Validate checks the options, except the clients, which Run checks.
func (o Options) Validate() error {
	for _, s := range []Store{o.From, o.To} {
		if s != KVStore && s != CRD {
			return fmt.Errorf("invalid store %q: want %q or %q", s, KVStore, CRD)
		}
	}
	if o.From == o.To {
		return fmt.Errorf("source and target are both %q: migrate copies between the two stores", o.From)
	}
	if err := o.Cluster.Validate(); err != nil {
		return fmt.Errorf("invalid cluster configuration: %w", err)
	}
	if o.Hold < MinHold || o.Hold > MaxHold {
		return fmt.Errorf("invalid hold %s: want %s .. %s", o.Hold, MinHold, MaxHold)
	}
	if o.HoldNode == "" {
		return errors.New("empty hold node name")
	}
	return nil
}

// Entry is one identity: its ID and its label set's canonical string.
type Entry struct {
	ID     uint32 `json:"id"`
	Labels string `json:"labels"`
}

// Conflict is a source identity whose ID the target gives another label
// set: as in Cilium's preflight, the label set gets NewID in the target.
type Conflict struct {
	// ID and Labels are the source identity; TargetLabels what the target
	// holds at ID (the object's or key's raw content when it does not
	// parse).
	ID           uint32 `json:"id"`
	Labels       string `json:"labels"`
	TargetLabels string `json:"targetLabels"`
	// NewID is the label set's ID in the target: an ID it already had
	// there, or a new one.
	NewID uint32 `json:"newID"`
}

// Elsewhere is a source identity whose ID is free in the target while the
// target holds its label set at other IDs: nothing is created, since one
// label set must not get two IDs.
type Elsewhere struct {
	ID        uint32   `json:"id"`
	Labels    string   `json:"labels"`
	TargetIDs []uint32 `json:"targetIDs"`
}

// Skipped is a source key or object that is not migrated.
type Skipped struct {
	// Name is the master key's ID or the object's name.
	Name   string `json:"name"`
	Value  string `json:"value"`
	Reason string `json:"reason"`
}

// Hold says what keeps the migrated identities from the target's garbage
// collection, and until when.
type Hold struct {
	Node  string    `json:"node"`
	Until time.Time `json:"until"`
	IDs   int       `json:"ids"`
}

// Report is what a run did, or would do with DryRun.
type Report struct {
	From   Store `json:"from"`
	To     Store `json:"to"`
	DryRun bool  `json:"dryRun"`
	// Source counts the source identities read (skipped ones included).
	Source int `json:"source"`
	// Created: created in the target with their ID by this run (or that
	// it would create). Present: the target had them already.
	Created []Entry `json:"created"`
	Present []Entry `json:"present"`
	// Conflicts, sorted by ID; NewIDsCreated counts the new IDs this run
	// created for them (the others the target had).
	Conflicts     []Conflict  `json:"conflicts"`
	NewIDsCreated int         `json:"newIDsCreated"`
	Elsewhere     []Elsewhere `json:"elsewhere"`
	Skipped       []Skipped   `json:"skipped"`
	Hold          *Hold       `json:"hold,omitempty"`
}

// item is one ID of a store as listed.
type item struct {
	id identity.NumericIdentity
	// lbls and key are the label set and its canonical string; nil and ""
	// when the content does not parse (err says why, raw is the content).
	lbls labels.Labels
	key  string
	raw  string
	err  error
	// obj is the CRD store's object (nil in etcd); marked and rv its
	// heartbeat mark and resourceVersion.
	obj    *crdstore.CiliumIdentity
	marked bool
	rv     string
	// referenced: in etcd, other nodes' reference keys of the label set
	// name this ID (read only for label sets held at several master keys).
	referenced bool
}

// end is one store, as source or target.
type end interface {
	// list returns every ID the store holds, whatever its content, and
	// the names that hold no ID (skipped as sources).
	list(ctx context.Context) (map[identity.NumericIdentity]*item, []Skipped, error)
	// prepare readies the target for writes (CRDs, the hold's lease).
	prepare(ctx context.Context) error
	// create writes id for lbls only if the store has no id; it returns
	// the holder of id when it had one (nil when created).
	create(ctx context.Context, id identity.NumericIdentity, lbls labels.Labels) (*item, error)
	// unmark removes the CRD store's heartbeat mark (a no-op in etcd).
	unmark(ctx context.Context, it *item) error
	// hold keeps what h holds from the garbage collection for the hold's
	// duration.
	hold(ctx context.Context, h holding) error
	// skip reports why lbls cannot be written to this store ("" when it
	// can), given the label sets it will hold.
	skip(lbls labels.Labels, key string) string
	// choose returns the ID the store answers for a label set it holds
	// at several IDs, given their items as listed; InvalidIdentity when
	// the store takes none of them.
	choose(its []*item) identity.NumericIdentity
}

// Run migrates from o.From to o.To and reports what it did. Conflicts,
// identities the target holds elsewhere and skipped entries are reported,
// not errors.
func Run(ctx context.Context, o Options) (*Report, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	if o.Etcd == nil || o.K8s == nil {
		return nil, errors.New("migrate needs both an etcd client and a Kubernetes API server")
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	ends := map[Store]end{
		KVStore: newEtcdEnd(o),
		CRD:     newCRDEnd(o),
	}
	src, tgt := ends[o.From], ends[o.To]

	srcItems, srcSkipped, err := src.list(ctx)
	if err != nil {
		return nil, fmt.Errorf("listing the source (%s): %w", o.From, err)
	}
	sources, skipped := sourceEntries(srcItems, o.Cluster)
	skipped = append(skipped, srcSkipped...)

	if !o.DryRun {
		if err := tgt.prepare(ctx); err != nil {
			return nil, fmt.Errorf("preparing the target (%s): %w", o.To, err)
		}
	}
	created := map[identity.NumericIdentity]bool{}
	for round := 0; ; round++ {
		tgtItems, _, err := tgt.list(ctx)
		if err != nil {
			return nil, fmt.Errorf("listing the target (%s): %w", o.To, err)
		}
		p := plan(sources, tgtItems, o.Cluster, tgt)
		if o.DryRun {
			return p.report(o, len(srcItems), skipped, nil), nil
		}
		// The hold is written before the objects, so that none of them is
		// ever unprotected, and again once the plan's IDs are final.
		if err := tgt.hold(ctx, p.held); err != nil {
			return nil, fmt.Errorf("holding the migrated identities: %w", err)
		}
		raced, err := p.write(ctx, o, tgt, created)
		if err != nil {
			return nil, err
		}
		if raced {
			if round+1 >= maxRounds {
				return nil, fmt.Errorf("other writers kept taking the IDs planned in the target (%d rounds); run again once they are done", maxRounds)
			}
			o.Log.Info("Another writer took a planned ID: listing the target again")
			continue
		}
		if err := tgt.hold(ctx, p.held); err != nil {
			return nil, fmt.Errorf("holding the migrated identities: %w", err)
		}
		return p.report(o, len(srcItems), skipped, created), nil
	}
}

// sourceEntries returns the source identities to migrate, sorted by ID,
// and the ones skipped: labels that do not parse, IDs outside the range.
func sourceEntries(items map[identity.NumericIdentity]*item, cluster identity.ClusterInfo) ([]*item, []Skipped) {
	var out []*item
	var skipped []Skipped
	for _, it := range items {
		switch {
		case it.err != nil:
			skipped = append(skipped, Skipped{Name: it.id.String(), Value: it.raw, Reason: it.err.Error()})
		case it.id < cluster.MinID() || it.id > cluster.MaxID():
			skipped = append(skipped, Skipped{Name: it.id.String(), Value: it.key,
				Reason: fmt.Sprintf("ID outside this cluster's range %d..%d", cluster.MinID(), cluster.MaxID())})
		default:
			out = append(out, it)
		}
	}
	slices.SortFunc(out, func(a, b *item) int { return cmp.Compare(a.id, b.id) })
	return out, skipped
}

// planned is one write of a plan.
type planned struct {
	id   identity.NumericIdentity
	lbls labels.Labels
	key  string
	// conflict is the index of the conflict this ID is new for, or -1.
	conflict int
}

// thePlan is what one round will write, and its report.
type thePlan struct {
	creates   []planned // same ID first, then new IDs of conflicts
	unmark    []*item   // target objects to unmark (held or skipped over)
	present   []Entry
	conflicts []Conflict
	elsewhere []Elsewhere
	skipped   []Skipped
	held      holding
}

// holding is what a round holds in the target.
type holding struct {
	// ids holds every ID kept, with its label set.
	ids map[identity.NumericIdentity]labels.Labels
	// named maps the canonical string of every label set kept to the ID
	// the plan gives it, which the target's store answers for it (choose;
	// InvalidIdentity when the store takes none); a label set with several
	// IDs is there once.
	named map[string]identity.NumericIdentity
}

// plan decides, from the listings alone, what the target gets. Sources go
// in ID order: first every source whose ID is free gets it (unless the
// target holds its label set elsewhere); then each conflict, in ID order,
// takes the target's ID of its label set (of several, the one the target's
// store answers: tgt.choose) or the first free ID of its probe sequence.
// The same listings give the same plan, so a run started again after a
// kill plans what is left of the first run's plan.
func plan(sources []*item, target map[identity.NumericIdentity]*item, cluster identity.ClusterInfo, tgt end) *thePlan {
	p := &thePlan{held: holding{ids: map[identity.NumericIdentity]labels.Labels{}, named: map[string]identity.NumericIdentity{}}}
	// held: every ID the target has or will have; byKey: the IDs of each
	// label set there.
	held := make(map[identity.NumericIdentity]*item, len(target)+len(sources))
	byKey := map[string][]identity.NumericIdentity{}
	for id, it := range target {
		held[id] = it
		if it.err == nil {
			byKey[it.key] = append(byKey[it.key], id)
		}
	}
	for _, ids := range byKey {
		slices.Sort(ids)
	}
	keep := func(id identity.NumericIdentity, lbls labels.Labels) {
		p.held.ids[id] = lbls
		if it := target[id]; it != nil && it.marked {
			p.unmark = append(p.unmark, it)
		}
	}

	var pending []*item
	for _, s := range sources {
		if reason := tgt.skip(s.lbls, s.key); reason != "" {
			p.skipped = append(p.skipped, Skipped{Name: s.id.String(), Value: s.key, Reason: reason})
			continue
		}
		if t, ok := held[s.id]; ok {
			if t.err == nil && t.key == s.key {
				p.present = append(p.present, Entry{uint32(s.id), s.key})
				keep(s.id, s.lbls)
			} else {
				pending = append(pending, s)
			}
			continue
		}
		if ids := byKey[s.key]; len(ids) > 0 {
			e := Elsewhere{ID: uint32(s.id), Labels: s.key}
			for _, id := range ids {
				e.TargetIDs = append(e.TargetIDs, uint32(id))
				keep(id, s.lbls)
			}
			p.elsewhere = append(p.elsewhere, e)
			continue
		}
		p.creates = append(p.creates, planned{id: s.id, lbls: s.lbls, key: s.key, conflict: -1})
		held[s.id] = s
		byKey[s.key] = []identity.NumericIdentity{s.id}
		keep(s.id, s.lbls)
	}

	for _, s := range pending {
		t := held[s.id]
		c := Conflict{ID: uint32(s.id), Labels: s.key, TargetLabels: t.key}
		if t.err != nil {
			c.TargetLabels = t.raw
		}
		ids := byKey[s.key]
		if has := choose(tgt, ids, held); has != identity.InvalidIdentity {
			c.NewID = uint32(has)
			for _, id := range ids {
				keep(id, s.lbls)
			}
		} else {
			id, skipped := walk(s.key, held, cluster)
			if id == identity.InvalidIdentity {
				p.skipped = append(p.skipped, Skipped{Name: s.id.String(), Value: s.key,
					Reason: "conflict, and no free ID left in this cluster's range"})
				continue
			}
			for _, sk := range skipped {
				if target[sk] != nil && target[sk].marked {
					p.unmark = append(p.unmark, target[sk])
				}
			}
			c.NewID = uint32(id)
			p.creates = append(p.creates, planned{id: id, lbls: s.lbls, key: s.key, conflict: len(p.conflicts)})
			held[id] = &item{id: id, lbls: s.lbls, key: s.key}
			byKey[s.key] = []identity.NumericIdentity{id}
			keep(id, s.lbls)
		}
		p.conflicts = append(p.conflicts, c)
	}
	for _, lbls := range p.held.ids {
		key := lbls.Canonical()
		if _, ok := p.held.named[key]; !ok {
			p.held.named[key] = choose(tgt, byKey[key], held)
		}
	}
	return p
}

// walk returns the first ID of key's probe sequence that held does not
// hold, and the held IDs it passed; InvalidIdentity when all are held.
// It is the CRD store's placement (docs/crd-store.md, "Placement").
func walk(key string, held map[identity.NumericIdentity]*item, cluster identity.ClusterInfo) (identity.NumericIdentity, []identity.NumericIdentity) {
	pr := idprobe.New(key, cluster)
	var passed []identity.NumericIdentity
	for i := uint64(0); i < pr.Len(); i++ {
		id := pr.Slot(i)
		if _, ok := held[id]; !ok {
			return id, passed
		}
		passed = append(passed, id)
	}
	return identity.InvalidIdentity, passed
}

// choose returns the ID of a label set the target holds at ids: the one,
// or the one the target's store answers of several; InvalidIdentity for
// none.
func choose(tgt end, ids []identity.NumericIdentity, held map[identity.NumericIdentity]*item) identity.NumericIdentity {
	switch len(ids) {
	case 0:
		return identity.InvalidIdentity
	case 1:
		return ids[0]
	}
	its := make([]*item, len(ids))
	for i, id := range ids {
		its[i] = held[id]
	}
	return tgt.choose(its)
}

// write sends the plan's unmarks and creates. raced is true when another
// writer took a planned ID: the round starts again from a new listing.
func (p *thePlan) write(ctx context.Context, o Options, tgt end, created map[identity.NumericIdentity]bool) (raced bool, err error) {
	for _, it := range p.unmark {
		if err := tgt.unmark(ctx, it); err != nil {
			return false, fmt.Errorf("removing the heartbeat mark of %d: %w", it.id, err)
		}
	}
	for _, c := range p.creates {
		holder, err := tgt.create(ctx, c.id, c.lbls)
		if err != nil {
			return false, fmt.Errorf("creating %d in the target (%s): %w", c.id, o.To, err)
		}
		if o.afterWrite != nil {
			o.afterWrite()
		}
		if holder != nil {
			if holder.err == nil && holder.key == c.key {
				// Written meanwhile by someone else: already what we want.
				continue
			}
			return true, nil
		}
		created[c.id] = true
	}
	return false, nil
}

// report turns the plan into the report; created holds the IDs this run
// created (nil for a dry run, where every planned create counts).
func (p *thePlan) report(o Options, source int, skipped []Skipped, created map[identity.NumericIdentity]bool) *Report {
	r := &Report{From: o.From, To: o.To, DryRun: o.DryRun, Source: source,
		Conflicts: p.conflicts, Elsewhere: p.elsewhere, Skipped: append(skipped, p.skipped...)}
	newIDs := map[uint32]bool{}
	for _, c := range p.creates {
		if c.conflict >= 0 {
			newIDs[uint32(c.id)] = true
		}
	}
	for _, c := range p.creates {
		if c.conflict < 0 {
			r.Created = append(r.Created, Entry{uint32(c.id), c.key})
		}
	}
	r.NewIDsCreated = len(newIDs)
	for _, e := range p.present {
		if created[identity.NumericIdentity(e.ID)] {
			r.Created = append(r.Created, e)
		} else {
			r.Present = append(r.Present, e)
		}
	}
	for _, c := range p.conflicts {
		if !newIDs[c.NewID] && created[identity.NumericIdentity(c.NewID)] {
			r.NewIDsCreated++
		}
	}
	slices.SortFunc(r.Created, func(a, b Entry) int { return cmp.Compare(a.ID, b.ID) })
	slices.SortFunc(r.Skipped, func(a, b Skipped) int { return cmp.Compare(a.Name, b.Name) })
	if !o.DryRun {
		r.Hold = &Hold{Node: o.HoldNode, Until: time.Now().Add(o.Hold).UTC().Truncate(time.Second), IDs: len(p.held.ids)}
	}
	return r
}
