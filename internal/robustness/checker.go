package robustness

import (
	"fmt"
	"maps"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/identityd/identityd/identity"
)

// ViolationKind names the property a violation breaks.
type ViolationKind string

// The properties the checker verifies.
const (
	// IDTwoLabelSets: one numeric ID stood for two label sets at the same
	// time (any nodes for global IDs, one node for local IDs).
	IDTwoLabelSets ViolationKind = "id-two-label-sets"
	// LabelSetTwoIDs: one label set had two numeric IDs at the same time
	// (across nodes for global sets, on one node for local sets).
	LabelSetTwoIDs ViolationKind = "label-set-two-ids"
	// LocalIDChanged: a local label set held across a node's restart came
	// back with another number.
	LocalIDChanged ViolationKind = "local-id-changed"
	// LateSuccess: an operation succeeded after its caller's deadline.
	LateSuccess ViolationKind = "late-success"
	// ReferenceMissing: a live node holds a global identity but etcd has
	// no reference key of it (or one with another ID).
	ReferenceMissing ViolationKind = "reference-missing"
	// ReferenceOrphaned: etcd has a reference key no live node holds.
	ReferenceOrphaned ViolationKind = "reference-orphaned"
	// MasterMismatch: a reference key names an ID whose master key is
	// missing or holds another label set (in CRD mode: a live node holds
	// an identity whose CiliumIdentity object is missing or holds another
	// label set).
	MasterMismatch ViolationKind = "master-mismatch"
	// LabelSetTwoObjects: at the end, two CiliumIdentity objects hold one
	// label set (CRD mode, whose placement allows one).
	LabelSetTwoObjects ViolationKind = "label-set-two-objects"
)

// Violation is one broken property with the operations and events that
// show it, and nothing else.
type Violation struct {
	Kind   ViolationKind
	Msg    string
	Ops    []Op
	Events []Event
}

// Format prints the violation with its slice of history, times relative to
// begin.
func (v Violation) Format(begin time.Time) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s: %s\n", v.Kind, v.Msg)
	type line struct {
		t time.Time
		s string
	}
	var lines []line
	for _, op := range v.Ops {
		lines = append(lines, line{op.Start, FormatOp(begin, op)})
	}
	for _, e := range v.Events {
		lines = append(lines, line{e.Start, FormatEvent(begin, e)})
	}
	sort.SliceStable(lines, func(i, j int) bool { return lines[i].t.Before(lines[j].t) })
	for _, l := range lines {
		b.WriteString("    " + l.s + "\n")
	}
	return b.String()
}

func rel(begin, t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return fmt.Sprintf("%+.3fs", t.Sub(begin).Seconds())
}

// FormatOp prints one operation on one line.
func FormatOp(begin time.Time, op Op) string {
	res := string(op.Outcome)
	if op.Kind == OpAllocate && op.Outcome == OK {
		res = fmt.Sprintf("-> %d ok", op.ID)
	}
	arg := op.Labels
	if op.Kind == OpRelease {
		arg = fmt.Sprintf("%d (%s)", op.ID, op.Labels)
	}
	s := fmt.Sprintf("#%d [%s .. %s, deadline %s] %s %s %s %s", op.Seq, rel(begin, op.Start), rel(begin, op.End),
		rel(begin, op.Deadline), op.Node, op.Kind, arg, res)
	if op.Err != "" {
		s += ": " + op.Err
	}
	return s
}

// FormatEvent prints one event on one line.
func FormatEvent(begin time.Time, e Event) string {
	return fmt.Sprintf("[%s .. %s] %s %s", rel(begin, e.Start), rel(begin, e.End), e.Kind, e.Target)
}

// Checker verifies a history.
type Checker struct {
	// Settle is how long before a node's kill a local label set must have
	// been held to count as held across the restart: the node writes its
	// checkpoint at most this late after a change.
	Settle time.Duration
	// Grace is how long after a restarted node is ready it keeps restored
	// local identities; an allocation later than that may get a new ID.
	Grace time.Duration
}

// Result is what the checker found.
type Result struct {
	Violations []Violation
	// Holds is the number of definite holds (a node referencing an ID for
	// a label set over an interval) compared with each other.
	Holds int
	// LocalChecks counts local label sets whose number was verified after
	// a restart of their node.
	LocalChecks int
}

// hold is an interval in which a node certainly referenced ID for Labels:
// from the end of the allocation that took the first reference to the
// start of the release that dropped the last one, or the node's kill.
// Taking the later bound at each end keeps the checker from reporting
// overlaps that only uncertain timing produced.
type hold struct {
	node   string
	labels string
	global bool
	id     identity.NumericIdentity
	from   time.Time
	to     time.Time
	open   Op
	close  *Op
	killed *Event
}

func (h hold) ops() []Op {
	ops := []Op{h.open}
	if h.close != nil {
		ops = append(ops, *h.close)
	}
	return ops
}

func (h hold) events() []Event {
	if h.killed != nil {
		return []Event{*h.killed}
	}
	return nil
}

// Check verifies the history's operations: overlapping holds, local IDs
// across restarts, deadlines.
func (c Checker) Check(h *History) Result {
	h = h.Snapshot()
	var res Result
	holds := holdsOf(h)
	res.Holds = len(holds)
	res.Violations = append(res.Violations, overlaps(holds)...)
	v, n := c.localAcrossRestarts(h, holds)
	res.Violations = append(res.Violations, v...)
	res.LocalChecks = n
	for _, op := range h.Ops {
		if op.Outcome == OK && !op.Deadline.IsZero() && op.End.After(op.Deadline) {
			res.Violations = append(res.Violations, Violation{
				Kind: LateSuccess,
				Msg:  fmt.Sprintf("%s on %s succeeded %s after its deadline", op.Kind, op.Node, op.End.Sub(op.Deadline).Round(time.Millisecond)),
				Ops:  []Op{op},
			})
		}
	}
	return res
}

type holdKey struct {
	node, labels string
	id           identity.NumericIdentity
}

// holdsOf replays the history's reference counts per node, label set and
// ID. A release of any outcome is taken to drop its reference when it
// starts: a failed release may or may not have, and the shorter hold is
// the one that cannot produce a false report.
func holdsOf(h *History) []hold {
	type point struct {
		t     time.Time
		order int // closes before opens at the same instant
		op    *Op
		ev    *Event
	}
	var kills []*Event
	for i := range h.Events {
		if e := &h.Events[i]; e.Kind == NodeKill {
			kills = append(kills, e)
		}
	}
	// killedDuring reports whether op's node was killed while op ran: its
	// answer came from a process that was gone by the time the caller
	// saw it, so the reference it took ended with the kill, before the
	// hold would open at op's end.
	killedDuring := func(op *Op) bool {
		for _, e := range kills {
			if e.Target == op.Node && !e.Start.Before(op.Start) && e.Start.Before(op.End) {
				return true
			}
		}
		return false
	}
	var pts []point
	for i := range h.Ops {
		op := &h.Ops[i]
		switch {
		case op.Kind == OpAllocate && op.Outcome == OK:
			if killedDuring(op) {
				continue
			}
			pts = append(pts, point{t: op.End, order: 1, op: op})
		case op.Kind == OpRelease:
			pts = append(pts, point{t: op.Start, order: 0, op: op})
		}
	}
	for _, e := range kills {
		pts = append(pts, point{t: e.Start, order: 0, ev: e})
	}
	sort.SliceStable(pts, func(i, j int) bool {
		if !pts[i].t.Equal(pts[j].t) {
			return pts[i].t.Before(pts[j].t)
		}
		return pts[i].order < pts[j].order
	})

	type open struct {
		refs int
		h    hold
	}
	active := map[holdKey]*open{}
	var out []hold
	for _, p := range pts {
		switch {
		case p.ev != nil:
			for k, o := range active {
				if k.node == p.ev.Target {
					o.h.to, o.h.killed = p.ev.Start, p.ev
					out = append(out, o.h)
					delete(active, k)
				}
			}
		case p.op.Kind == OpAllocate:
			k := holdKey{p.op.Node, p.op.Labels, p.op.ID}
			o := active[k]
			if o == nil {
				o = &open{h: hold{node: k.node, labels: k.labels, global: p.op.Global, id: k.id, from: p.op.End, open: *p.op}}
				active[k] = o
			}
			o.refs++
		default:
			k := holdKey{p.op.Node, p.op.Labels, p.op.ID}
			o := active[k]
			if o == nil {
				continue
			}
			if o.refs--; o.refs == 0 {
				op := *p.op
				o.h.to, o.h.close = p.op.Start, &op
				out = append(out, o.h)
				delete(active, k)
			}
		}
	}
	// Holds still open at the end last forever.
	forever := time.Unix(1<<40, 0)
	for _, k := range slices.SortedFunc(maps.Keys(active), func(a, b holdKey) int {
		return active[a].h.from.Compare(active[b].h.from)
	}) {
		o := active[k]
		o.h.to = forever
		out = append(out, o.h)
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].from.Before(out[j].from) })
	return out
}

// overlaps reports pairs of holds that overlap in time and disagree: the
// same ID for two label sets, or two IDs for one label set. Global IDs and
// label sets are compared across nodes, local ones within their node.
func overlaps(holds []hold) []Violation {
	type group struct {
		key string
		hs  []hold
	}
	byID := map[string][]hold{}
	byLabels := map[string][]hold{}
	for _, h := range holds {
		scope := "global"
		if !h.global {
			scope = "local@" + h.node
		}
		idKey := fmt.Sprintf("%s/%d", scope, h.id)
		byID[idKey] = append(byID[idKey], h)
		lKey := scope + "/" + h.labels
		byLabels[lKey] = append(byLabels[lKey], h)
	}
	var out []Violation
	seen := map[string]bool{}
	check := func(groups map[string][]hold, kind ViolationKind, differ func(a, b hold) bool, msg func(a, b hold) string) {
		for _, key := range slices.Sorted(maps.Keys(groups)) {
			hs := groups[key]
			for i := range hs {
				for j := i + 1; j < len(hs); j++ {
					a, b := hs[i], hs[j]
					if !b.from.Before(a.to) {
						// Holds are sorted by start: once one starts
						// after a ends, so do all that follow.
						break
					}
					if !differ(a, b) {
						continue
					}
					dedup := fmt.Sprintf("%s|%s|%s|%d|%d", kind, a.labels, b.labels, a.id, b.id)
					if seen[dedup] {
						continue
					}
					seen[dedup] = true
					ops := append(a.ops(), b.ops()...)
					sort.SliceStable(ops, func(i, j int) bool { return ops[i].Start.Before(ops[j].Start) })
					out = append(out, Violation{
						Kind:   kind,
						Msg:    msg(a, b),
						Ops:    ops,
						Events: append(a.events(), b.events()...),
					})
				}
			}
		}
	}
	check(byID, IDTwoLabelSets,
		func(a, b hold) bool { return a.labels != b.labels },
		func(a, b hold) string {
			return fmt.Sprintf("ID %d stood for %q on %s and for %q on %s at the same time", a.id, a.labels, a.node, b.labels, b.node)
		})
	check(byLabels, LabelSetTwoIDs,
		func(a, b hold) bool { return a.id != b.id },
		func(a, b hold) string {
			return fmt.Sprintf("label set %q had ID %d on %s and ID %d on %s at the same time", a.labels, a.id, a.node, b.id, b.node)
		})
	return out
}

// localAcrossRestarts checks that a local label set a node held when it
// was killed (for at least Settle) gets its old number from the node's
// first allocation of it after the restart, within the grace period.
func (c Checker) localAcrossRestarts(h *History, holds []hold) ([]Violation, int) {
	var out []Violation
	checked := 0
	for _, hd := range holds {
		if hd.global || hd.killed == nil || hd.from.After(hd.killed.Start.Add(-c.Settle)) {
			continue
		}
		kill := hd.killed
		var ready *Event
		nextKill := time.Unix(1<<40, 0)
		for i := range h.Events {
			e := &h.Events[i]
			if e.Target != hd.node {
				continue
			}
			if e.Kind == NodeReady && ready == nil && e.End.After(kill.Start) {
				ready = e
			}
			if e.Kind == NodeKill && e.Start.After(kill.Start) && e.Start.Before(nextKill) {
				nextKill = e.Start
			}
		}
		if ready == nil {
			continue
		}
		for _, op := range h.Ops {
			if op.Node != hd.node || op.Labels != hd.labels || op.Kind != OpAllocate || op.Outcome != OK ||
				op.Start.Before(kill.Start) || !op.End.Before(nextKill) {
				continue
			}
			if c.Grace > 0 && op.Start.After(ready.End.Add(c.Grace)) {
				break
			}
			checked++
			if op.ID != hd.id {
				out = append(out, Violation{
					Kind:   LocalIDChanged,
					Msg:    fmt.Sprintf("local label set %q was %d on %s before its restart and %d after", hd.labels, hd.id, hd.node, op.ID),
					Ops:    []Op{hd.open, op},
					Events: []Event{*kill, *ready},
				})
			}
			break
		}
	}
	return out, checked
}

// FinalState is what the live nodes and the global store hold once the run
// has ended and the store has settled: etcd's keys (RefKeys and Masters),
// or in CRD mode the API server's objects (NodeRefs and Masters).
type FinalState struct {
	// Held maps each live node to the global label sets (canonical) it
	// references, with their IDs: `identity/list` entries with
	// RefCount > 0.
	Held map[string]map[string]identity.NumericIdentity
	// RefKeys maps node names to the label sets of their reference keys
	// in etcd, with the IDs the keys hold.
	RefKeys map[string]map[string]identity.NumericIdentity
	// NodeRefs, in CRD mode, maps the names of IdentityNode objects to
	// the IDs they list; non-nil selects CRD mode's checks.
	NodeRefs map[string][]identity.NumericIdentity
	// Masters maps the IDs of master keys in etcd (of CiliumIdentity
	// objects in CRD mode) to their label sets.
	Masters map[identity.NumericIdentity]string
}

// CheckFinal compares the nodes' references with the store. In etcd mode:
// every reference a live node holds has its key, every key has a live
// holder, and every key names an ID whose master key holds the label set.
// In CRD mode: every global identity a live node holds is listed in its
// IdentityNode object and has a CiliumIdentity object with the label set,
// every listed ID is held by its live node, and no label set has two
// CiliumIdentity objects. Each violation comes with the node's last
// operations on the label set.
func CheckFinal(h *History, f FinalState) []Violation {
	fc := finalCheck{h: h.Snapshot()}
	if f.NodeRefs != nil {
		return fc.crd(f)
	}
	return fc.etcd(f)
}

type finalCheck struct{ h *History }

// lastOps returns the node's last operations on the label set (every
// node's when node is empty).
func (fc finalCheck) lastOps(node, lbls string) []Op {
	var ops []Op
	for _, op := range fc.h.Ops {
		if (node == "" || op.Node == node) && op.Labels == lbls {
			ops = append(ops, op)
		}
	}
	if len(ops) > 3 {
		ops = ops[len(ops)-3:]
	}
	return ops
}

func (fc finalCheck) etcd(f FinalState) []Violation {
	lastOps := fc.lastOps
	var out []Violation
	for _, node := range slices.Sorted(maps.Keys(f.Held)) {
		for _, lbls := range slices.Sorted(maps.Keys(f.Held[node])) {
			id := f.Held[node][lbls]
			key, ok := f.RefKeys[node][lbls]
			switch {
			case !ok:
				out = append(out, Violation{Kind: ReferenceMissing, Ops: lastOps(node, lbls),
					Msg: fmt.Sprintf("%s holds %d for %q but etcd has no reference key of it", node, id, lbls)})
			case key != id:
				out = append(out, Violation{Kind: ReferenceMissing, Ops: lastOps(node, lbls),
					Msg: fmt.Sprintf("%s holds %d for %q but its reference key in etcd says %d", node, id, lbls, key)})
			}
		}
	}
	for _, node := range slices.Sorted(maps.Keys(f.RefKeys)) {
		for _, lbls := range slices.Sorted(maps.Keys(f.RefKeys[node])) {
			id := f.RefKeys[node][lbls]
			held, live := f.Held[node]
			if _, ok := held[lbls]; !ok {
				out = append(out, Violation{Kind: ReferenceOrphaned, Ops: lastOps(node, lbls),
					Msg: fmt.Sprintf("etcd has a reference key of %s to %d for %q but %s", node, id, lbls, notHeldWhy(live))})
			}
			if v, bad := fc.masterMismatch(f, node, lbls, id,
				fmt.Sprintf("reference key of %s names %d for %q but master key %d", node, id, lbls, id)); bad {
				out = append(out, v)
			}
		}
	}
	return out
}

// masterMismatch reports whether the master of id (key or object) is
// missing or holds another label set than lbls, and the violation that says
// so, msg followed by what the master holds.
func (fc finalCheck) masterMismatch(f FinalState, node, lbls string, id identity.NumericIdentity, msg string) (Violation, bool) {
	m, ok := f.Masters[id]
	switch {
	case ok && m == lbls:
		return Violation{}, false
	case ok:
		msg += fmt.Sprintf(" holds %q", m)
	default:
		msg += " does not exist"
	}
	return Violation{Kind: MasterMismatch, Msg: msg, Ops: fc.lastOps(node, lbls)}, true
}

func notHeldWhy(live bool) string {
	if !live {
		return "the node is not running"
	}
	return "the node does not hold it"
}

func (fc finalCheck) crd(f FinalState) []Violation {
	var out []Violation
	for _, node := range slices.Sorted(maps.Keys(f.Held)) {
		listed := f.NodeRefs[node]
		for _, lbls := range slices.Sorted(maps.Keys(f.Held[node])) {
			id := f.Held[node][lbls]
			if !slices.Contains(listed, id) {
				out = append(out, Violation{Kind: ReferenceMissing, Ops: fc.lastOps(node, lbls),
					Msg: fmt.Sprintf("%s holds %d for %q but its IdentityNode object does not list it", node, id, lbls)})
			}
			if v, bad := fc.masterMismatch(f, node, lbls, id,
				fmt.Sprintf("%s holds %d for %q but CiliumIdentity %d", node, id, lbls, id)); bad {
				out = append(out, v)
			}
		}
	}
	for _, node := range slices.Sorted(maps.Keys(f.NodeRefs)) {
		held, live := f.Held[node]
		for _, id := range f.NodeRefs[node] {
			if slices.Contains(slices.Collect(maps.Values(held)), id) {
				continue
			}
			lbls := f.Masters[id]
			out = append(out, Violation{Kind: ReferenceOrphaned, Ops: fc.lastOps(node, lbls),
				Msg: fmt.Sprintf("the IdentityNode object of %s lists %d (%q) but %s", node, id, lbls, notHeldWhy(live))})
		}
	}
	byLabels := map[string][]identity.NumericIdentity{}
	for id, lbls := range f.Masters {
		byLabels[lbls] = append(byLabels[lbls], id)
	}
	for _, lbls := range slices.Sorted(maps.Keys(byLabels)) {
		if ids := byLabels[lbls]; len(ids) > 1 {
			slices.Sort(ids)
			out = append(out, Violation{Kind: LabelSetTwoObjects, Ops: fc.lastOps("", lbls),
				Msg: fmt.Sprintf("label set %q has %d CiliumIdentity objects: %v", lbls, len(ids), ids)})
		}
	}
	return out
}
