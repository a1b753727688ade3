package robustness

import (
	"strings"
	"testing"
	"time"

	"github.com/identityd/identityd/identity"
)

// builder writes hand-made histories on a clock of whole seconds.
type builder struct {
	h  *History
	t0 time.Time
}

func newBuilder() *builder {
	t0 := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	return &builder{h: &History{Begin: t0}, t0: t0}
}

func (b *builder) at(s float64) time.Time { return b.t0.Add(time.Duration(s * float64(time.Second))) }

func (b *builder) op(node string, kind OpKind, lbls string, global bool, id identity.NumericIdentity, start, end float64, out Outcome) *builder {
	b.h.AddOp(Op{Node: node, Kind: kind, Labels: lbls, Global: global, ID: id,
		Start: b.at(start), End: b.at(end), Deadline: b.at(start + 10), Outcome: out})
	return b
}

func (b *builder) alloc(node, lbls string, id identity.NumericIdentity, start, end float64) *builder {
	return b.op(node, OpAllocate, lbls, !strings.HasPrefix(lbls, "cidr:"), id, start, end, OK)
}

func (b *builder) release(node, lbls string, id identity.NumericIdentity, start, end float64) *builder {
	return b.op(node, OpRelease, lbls, !strings.HasPrefix(lbls, "cidr:"), id, start, end, OK)
}

func (b *builder) event(kind EventKind, target string, start, end float64) *builder {
	b.h.AddEvent(Event{Kind: kind, Target: target, Start: b.at(start), End: b.at(end)})
	return b
}

const (
	web   = "k8s:app=web"
	db    = "k8s:app=db"
	cidrA = "cidr:10.0.0.0/8,reserved:world"
	cidrB = "cidr:10.1.0.0/16,reserved:world"
)

var checker = Checker{Settle: 2 * time.Second, Grace: 30 * time.Second}

// clean is a history a correct system produces: shared global IDs, an ID
// reused after every holder released it, local numbers kept across a
// restart, failures and unknown outcomes.
func clean() *builder {
	return newBuilder().
		alloc("n1", web, 1000, 0, 1).
		alloc("n2", web, 1000, 0.5, 1.5).
		release("n1", web, 1000, 2, 2.1).
		release("n2", web, 1000, 3, 3.1).
		// After both released, the GC may give 1000 to another set.
		alloc("n3", db, 1000, 4, 5).
		// Local IDs are per node: n2 may use 16777217 for another set.
		alloc("n1", cidrA, 16777217, 0, 0.1).
		alloc("n2", cidrB, 16777217, 0, 0.1).
		op("n2", OpAllocate, db, true, 0, 6, 16, Unknown).
		op("n3", OpAllocate, web, true, 0, 6, 9, Failed).
		event(NodeKill, "n1", 10, 10).
		event(NodeReady, "n1", 10, 12).
		alloc("n1", cidrA, 16777217, 12.5, 12.6).
		// A release that failed shortens the hold; the set may then
		// legitimately come back with another ID.
		alloc("n2", web, 1001, 20, 21)
}

func TestCheckerCleanHistory(t *testing.T) {
	b := clean()
	res := checker.Check(b.h)
	for _, v := range res.Violations {
		t.Errorf("false positive: %s", v.Format(b.t0))
	}
	if res.LocalChecks != 1 {
		t.Errorf("local checks = %d, want 1", res.LocalChecks)
	}
	final := FinalState{
		Held:    map[string]map[string]identity.NumericIdentity{"n1": {}, "n2": {web: 1001}, "n3": {db: 1000}},
		RefKeys: map[string]map[string]identity.NumericIdentity{"n2": {web: 1001}, "n3": {db: 1000}},
		Masters: map[identity.NumericIdentity]string{1000: db, 1001: web},
	}
	for _, v := range CheckFinal(b.h, final) {
		t.Errorf("false positive: %s", v.Format(b.t0))
	}
}

func TestCheckerFindsViolations(t *testing.T) {
	for _, tc := range []struct {
		name string
		b    *builder
		kind ViolationKind
		// seqs are the operations the report must show, by sequence.
		seqs []int
	}{
		{
			name: "global ID for two label sets on two nodes",
			b:    newBuilder().alloc("n1", web, 1000, 0, 1).alloc("n3", "k8s:app=other", 5, 0, 1).alloc("n2", db, 1000, 2, 3),
			kind: IDTwoLabelSets,
			seqs: []int{1, 3},
		},
		{
			name: "global ID reused while a holder has not released yet",
			b: newBuilder().alloc("n1", web, 1000, 0, 1).alloc("n2", db, 1000, 2, 3).
				release("n1", web, 1000, 4, 5),
			kind: IDTwoLabelSets,
			seqs: []int{1, 2, 3},
		},
		{
			name: "local ID for two label sets on one node",
			b:    newBuilder().alloc("n1", cidrA, 16777217, 0, 1).alloc("n1", cidrB, 16777217, 2, 3),
			kind: IDTwoLabelSets,
			seqs: []int{1, 2},
		},
		{
			name: "nodes disagree on a global label set",
			b:    newBuilder().alloc("n1", web, 1000, 0, 1).alloc("n2", web, 1001, 0.5, 1.5),
			kind: LabelSetTwoIDs,
			seqs: []int{1, 2},
		},
		{
			name: "local number changed across a restart",
			b: newBuilder().alloc("n1", cidrA, 16777217, 0, 0.1).alloc("n1", cidrB, 16777218, 0, 0.1).
				event(NodeKill, "n1", 10, 10).event(NodeReady, "n1", 10, 12).
				alloc("n1", cidrA, 16777219, 12.5, 12.6),
			kind: LocalIDChanged,
			seqs: []int{1, 3},
		},
		{
			name: "success after the deadline",
			b:    newBuilder().alloc("n1", web, 1000, 0, 1).op("n2", OpAllocate, db, true, 1001, 0, 10.5, OK),
			kind: LateSuccess,
			seqs: []int{2},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := checker.Check(tc.b.h)
			if len(res.Violations) != 1 {
				for _, v := range res.Violations {
					t.Log(v.Format(tc.b.t0))
				}
				t.Fatalf("%d violations, want 1 of kind %s", len(res.Violations), tc.kind)
			}
			v := res.Violations[0]
			if v.Kind != tc.kind {
				t.Fatalf("kind %s, want %s:\n%s", v.Kind, tc.kind, v.Format(tc.b.t0))
			}
			var seqs []int
			for _, op := range v.Ops {
				seqs = append(seqs, op.Seq)
			}
			if len(seqs) != len(tc.seqs) {
				t.Fatalf("report shows operations %v, want %v:\n%s", seqs, tc.seqs, v.Format(tc.b.t0))
			}
			for i := range seqs {
				if seqs[i] != tc.seqs[i] {
					t.Fatalf("report shows operations %v, want %v:\n%s", seqs, tc.seqs, v.Format(tc.b.t0))
				}
			}
			t.Logf("reported:\n%s", v.Format(tc.b.t0))
		})
	}
}

// TestCheckerIsConservative: a local set held for less than Settle before
// the kill, or re-allocated after the grace period, is not checked; a
// release with an unknown outcome ends the hold; an allocation answered
// while its node was being killed holds nothing after the kill.
func TestCheckerIsConservative(t *testing.T) {
	b := newBuilder().
		alloc("n1", cidrA, 16777217, 9, 9.5).
		alloc("n1", "cidr:10.8.0.0/16,reserved:world", 16777250, 9.9, 10.001).
		alloc("n1", "cidr:10.8.0.0/16,reserved:world", 16777219, 12.5, 12.6).
		alloc("n1", cidrB, 16777218, 0, 0.1).
		event(NodeKill, "n1", 10, 10).event(NodeReady, "n1", 10, 12).
		alloc("n1", cidrA, 16777300, 12.5, 12.6).
		alloc("n1", cidrB, 16777301, 50, 50.1).
		alloc("n2", web, 1000, 0, 1).
		op("n2", OpRelease, web, true, 1000, 2, 12, Unknown).
		alloc("n3", web, 1001, 3, 4)
	res := checker.Check(b.h)
	for _, v := range res.Violations {
		t.Errorf("false positive: %s", v.Format(b.t0))
	}
	if res.LocalChecks != 0 {
		t.Errorf("local checks = %d, want 0", res.LocalChecks)
	}
}

// finalCase is a final state and the kinds of violation CheckFinal must
// report for it, in order.
type finalCase struct {
	name  string
	final FinalState
	kinds []ViolationKind
}

// finalHistory is the history the final-state cases are checked against.
func finalHistory() *builder {
	return newBuilder().alloc("n1", web, 1000, 0, 1).alloc("n2", db, 1001, 0, 1).alloc("n3", web, 1000, 0, 1)
}

func TestCheckFinal(t *testing.T) {
	checkFinalCases(t, []finalCase{
		{
			name: "held without reference key",
			final: FinalState{
				Held:    map[string]map[string]identity.NumericIdentity{"n1": {web: 1000}, "n2": {db: 1001}},
				RefKeys: map[string]map[string]identity.NumericIdentity{"n2": {db: 1001}},
				Masters: map[identity.NumericIdentity]string{1000: web, 1001: db},
			},
			kinds: []ViolationKind{ReferenceMissing},
		},
		{
			name: "reference key with another ID",
			final: FinalState{
				Held:    map[string]map[string]identity.NumericIdentity{"n1": {web: 1000}},
				RefKeys: map[string]map[string]identity.NumericIdentity{"n1": {web: 1002}},
				Masters: map[identity.NumericIdentity]string{1000: web, 1002: web},
			},
			kinds: []ViolationKind{ReferenceMissing},
		},
		{
			name: "reference key of a node that dropped it",
			final: FinalState{
				Held:    map[string]map[string]identity.NumericIdentity{"n1": {}, "n2": {db: 1001}},
				RefKeys: map[string]map[string]identity.NumericIdentity{"n1": {web: 1000}, "n2": {db: 1001}},
				Masters: map[identity.NumericIdentity]string{1000: web, 1001: db},
			},
			kinds: []ViolationKind{ReferenceOrphaned},
		},
		{
			name: "reference key of a node that is gone",
			final: FinalState{
				Held:    map[string]map[string]identity.NumericIdentity{"n1": {}},
				RefKeys: map[string]map[string]identity.NumericIdentity{"n3": {web: 1000}},
				Masters: map[identity.NumericIdentity]string{1000: web},
			},
			kinds: []ViolationKind{ReferenceOrphaned},
		},
		{
			name: "reference key without master key",
			final: FinalState{
				Held:    map[string]map[string]identity.NumericIdentity{"n2": {db: 1001}},
				RefKeys: map[string]map[string]identity.NumericIdentity{"n2": {db: 1001}},
				Masters: map[identity.NumericIdentity]string{1001: web},
			},
			kinds: []ViolationKind{MasterMismatch},
		},
	})
}

func checkFinalCases(t *testing.T, cases []finalCase) {
	b := finalHistory()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			vs := CheckFinal(b.h, tc.final)
			if len(vs) != len(tc.kinds) {
				for _, v := range vs {
					t.Log(v.Format(b.t0))
				}
				t.Fatalf("%d violations, want %v", len(vs), tc.kinds)
			}
			for i, v := range vs {
				if v.Kind != tc.kinds[i] {
					t.Errorf("kind %s, want %s", v.Kind, tc.kinds[i])
				}
				if len(v.Ops) == 0 {
					t.Errorf("%s reported without the operations behind it", v.Kind)
				}
				t.Logf("reported:\n%s", v.Format(b.t0))
			}
		})
	}
}

func TestCheckFinalCRD(t *testing.T) {
	checkFinalCases(t, []finalCase{
		{
			name: "agreement",
			final: FinalState{
				Held:     map[string]map[string]identity.NumericIdentity{"n1": {web: 1000}, "n2": {db: 1001}, "n3": {}},
				NodeRefs: map[string][]identity.NumericIdentity{"n1": {1000}, "n2": {1001}, "n3": {}},
				Masters:  map[identity.NumericIdentity]string{1000: web, 1001: db},
			},
		},
		{
			name: "held but not listed",
			final: FinalState{
				Held:     map[string]map[string]identity.NumericIdentity{"n1": {web: 1000}, "n2": {db: 1001}},
				NodeRefs: map[string][]identity.NumericIdentity{"n2": {1001}},
				Masters:  map[identity.NumericIdentity]string{1000: web, 1001: db},
			},
			kinds: []ViolationKind{ReferenceMissing},
		},
		{
			name: "held without its object",
			final: FinalState{
				Held:     map[string]map[string]identity.NumericIdentity{"n1": {web: 1000}},
				NodeRefs: map[string][]identity.NumericIdentity{"n1": {1000}},
				Masters:  map[identity.NumericIdentity]string{},
			},
			kinds: []ViolationKind{MasterMismatch},
		},
		{
			name: "held with an object of another label set",
			final: FinalState{
				Held:     map[string]map[string]identity.NumericIdentity{"n2": {db: 1001}},
				NodeRefs: map[string][]identity.NumericIdentity{"n2": {1001}},
				Masters:  map[identity.NumericIdentity]string{1001: web},
			},
			kinds: []ViolationKind{MasterMismatch},
		},
		{
			name: "listed but not held",
			final: FinalState{
				Held:     map[string]map[string]identity.NumericIdentity{"n1": {}, "n2": {db: 1001}},
				NodeRefs: map[string][]identity.NumericIdentity{"n1": {1000}, "n2": {1001}},
				Masters:  map[identity.NumericIdentity]string{1000: web, 1001: db},
			},
			kinds: []ViolationKind{ReferenceOrphaned},
		},
		{
			name: "listed by a node that is gone",
			final: FinalState{
				Held:     map[string]map[string]identity.NumericIdentity{"n1": {}},
				NodeRefs: map[string][]identity.NumericIdentity{"n3": {1000}},
				Masters:  map[identity.NumericIdentity]string{1000: web},
			},
			kinds: []ViolationKind{ReferenceOrphaned},
		},
		{
			name: "two objects of one label set",
			final: FinalState{
				Held:     map[string]map[string]identity.NumericIdentity{"n1": {web: 1000}},
				NodeRefs: map[string][]identity.NumericIdentity{"n1": {1000}},
				Masters:  map[identity.NumericIdentity]string{1000: web, 1001: db, 1002: web},
			},
			kinds: []ViolationKind{LabelSetTwoObjects},
		},
	})
}
