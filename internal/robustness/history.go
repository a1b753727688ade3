package robustness

import (
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"sync"
	"time"

	"github.com/identityd/identityd/identity"
)

// OpKind is what a client asked a node to do.
type OpKind string

// Operations the workload issues.
const (
	OpAllocate OpKind = "allocate"
	OpRelease  OpKind = "release"
)

// Outcome is what the client learned about an operation.
type Outcome string

// Outcomes of operations. An operation whose answer never came (the node
// died, the client gave up) is Unknown: it may or may not have taken
// effect, and the checker treats it as both.
const (
	OK      Outcome = "ok"
	Failed  Outcome = "fail"
	Unknown Outcome = "unknown"
)

// Op is one operation of the workload and its result.
type Op struct {
	// Seq numbers operations in the order they were recorded (completed);
	// it names them in reports.
	Seq  int    `json:"seq"`
	Node string `json:"node"`
	Kind OpKind `json:"kind"`
	// Labels is the canonical label set allocated, or the one the client
	// believes the released ID stands for.
	Labels string `json:"labels"`
	// Global says the label set has global scope (the same ID on every
	// node); otherwise it is node-local.
	Global bool `json:"global"`
	// ID is the identity returned by an allocation, or the one released.
	ID       identity.NumericIdentity `json:"id,omitempty"`
	Start    time.Time                `json:"start"`
	End      time.Time                `json:"end"`
	Deadline time.Time                `json:"deadline"`
	Outcome  Outcome                  `json:"outcome"`
	Err      string                   `json:"error,omitempty"`
}

// EventKind is a fault or a change of a node's life.
type EventKind string

// Events the fault injector records.
const (
	// NodeKill: the node's process was killed (SIGKILL) at Start; every
	// reference it held in memory is gone.
	NodeKill EventKind = "node-kill"
	// NodeReady: the node's new process answers its shell (End).
	NodeReady      EventKind = "node-ready"
	EtcdKill       EventKind = "etcd-kill"
	EtcdPause      EventKind = "etcd-pause"
	EtcdRestartAll EventKind = "etcd-restart-all"
	// APIServerRestart: the Kubernetes API server was stopped (SIGTERM)
	// and started again (CRD mode).
	APIServerRestart EventKind = "apiserver-restart"
	// APIServerKill: the API server was killed (SIGKILL) and started
	// again a moment later (CRD mode).
	APIServerKill EventKind = "apiserver-kill"
)

// Event is a fault or life event; Start and End bound it.
type Event struct {
	Kind   EventKind `json:"kind"`
	Target string    `json:"target"`
	Start  time.Time `json:"start"`
	End    time.Time `json:"end"`
}

// History is the record of a run. Recording is safe for concurrent use.
type History struct {
	mu     sync.Mutex
	Begin  time.Time `json:"begin"`
	Ops    []Op      `json:"ops"`
	Events []Event   `json:"events"`
}

// NewHistory starts an empty history at now.
func NewHistory() *History { return &History{Begin: time.Now()} }

// AddOp records a finished operation and returns it with its sequence
// number.
func (h *History) AddOp(op Op) Op {
	h.mu.Lock()
	defer h.mu.Unlock()
	op.Seq = len(h.Ops) + 1
	h.Ops = append(h.Ops, op)
	return op
}

// AddEvent records a fault or life event.
func (h *History) AddEvent(e Event) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.Events = append(h.Events, e)
}

// Snapshot returns a copy with operations and events ordered by start time,
// for the checker.
func (h *History) Snapshot() *History {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := &History{Begin: h.Begin, Ops: append([]Op(nil), h.Ops...), Events: append([]Event(nil), h.Events...)}
	sort.SliceStable(out.Ops, func(i, j int) bool { return out.Ops[i].Start.Before(out.Ops[j].Start) })
	sort.SliceStable(out.Events, func(i, j int) bool { return out.Events[i].Start.Before(out.Events[j].Start) })
	return out
}

// WriteJSON writes the history, for inspection after a failed run.
func (h *History) WriteJSON(w io.Writer) error {
	s := h.Snapshot()
	enc := json.NewEncoder(w)
	enc.SetIndent("", " ")
	return enc.Encode(s)
}

// Stats counts a history's operations and faults.
type Stats struct {
	Ops, OK, Failed, Unknown int
	Allocations, Releases    int
	GlobalOps, LocalOps      int
	Faults                   map[EventKind]int
}

// Stats sums up the history.
func (h *History) Stats() Stats {
	h.mu.Lock()
	defer h.mu.Unlock()
	s := Stats{Faults: map[EventKind]int{}}
	for _, op := range h.Ops {
		s.Ops++
		switch op.Outcome {
		case OK:
			s.OK++
		case Failed:
			s.Failed++
		default:
			s.Unknown++
		}
		if op.Kind == OpAllocate {
			s.Allocations++
		} else {
			s.Releases++
		}
		if op.Global {
			s.GlobalOps++
		} else {
			s.LocalOps++
		}
	}
	for _, e := range h.Events {
		if e.Kind != NodeReady {
			s.Faults[e.Kind]++
		}
	}
	return s
}

func (s Stats) String() string {
	str := fmt.Sprintf("%d operations (%d ok, %d failed, %d unknown; %d allocations, %d releases; %d global, %d local); faults: %d etcd kill, %d etcd pause, %d etcd cluster restart, %d node kill",
		s.Ops, s.OK, s.Failed, s.Unknown, s.Allocations, s.Releases, s.GlobalOps, s.LocalOps,
		s.Faults[EtcdKill], s.Faults[EtcdPause], s.Faults[EtcdRestartAll], s.Faults[NodeKill])
	if n, k := s.Faults[APIServerRestart], s.Faults[APIServerKill]; n+k > 0 {
		str += fmt.Sprintf(", %d API server restart, %d API server kill", n, k)
	}
	return str
}
