package scalebench

import (
	"bufio"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"strings"
	"time"
)

// A record is one run's result as a line of JSON: SCALE_SAVE appends each
// run's, and SCALE_LOAD prints the rates by N and the extrapolation of
// saved runs again, from one or several files, without running anything.
type record struct {
	Mode       string             `json:"mode"`
	Nodes      int                `json:"nodes"`
	Identities int                `json:"identities"`
	Shared     int                `json:"shared"`
	GCInterval float64            `json:"gcIntervalSeconds"`
	Churn      float64            `json:"churnPerNode"`
	Steady     recordWindow       `json:"steady"`
	ChurnWin   recordWindow       `json:"churn"`
	GCPer      [4]*float64        `json:"gcRun"`
	Setup      float64            `json:"setupSeconds"`
	Settle     float64            `json:"settleSeconds"`
	Wall       float64            `json:"wallSeconds"`
	Created    int                `json:"created"`
	Peak       map[string]float64 `json:"peakRSS"`
	Logged     int64              `json:"logged"`
	Failed     int64              `json:"failedChanges"`
	When       time.Time          `json:"when"`
}

type recordWindow struct {
	Name       string                 `json:"name"`
	Secs       float64                `json:"seconds"`
	Rows       []recordRow            `json:"rows"`
	ByClass    map[string][4]*float64 `json:"byClass"`
	SentEst    map[string]bool        `json:"sentEstimated"`
	Sent       *float64               `json:"sent"`
	Recv       *float64               `json:"recv"`
	GC         [6]uint64              `json:"gc"`
	Collectors int                    `json:"collectors"`
	Changes    float64                `json:"changes"`
	Renewals   float64                `json:"renewals"`
}

type recordRow struct {
	Kind     string   `json:"kind"`
	Class    string   `json:"class"`
	GC       bool     `json:"gc"`
	Requests float64  `json:"requests"`
	Events   float64  `json:"events"`
	Sent     *float64 `json:"sent"`
	Recv     *float64 `json:"recv"`
	SentEst  bool     `json:"sentEstimated"`
}

// num and fromNum carry NaN (not counted) as null.
func num(v float64) *float64 {
	if math.IsNaN(v) {
		return nil
	}
	return &v
}

func fromNum(p *float64) float64 {
	if p == nil {
		return math.NaN()
	}
	return *p
}

func costRecord(c cost) [4]*float64 {
	return [4]*float64{num(c.requests), num(c.events), num(c.sent), num(c.recv)}
}

func costFrom(a [4]*float64) cost {
	return cost{fromNum(a[0]), fromNum(a[1]), fromNum(a[2]), fromNum(a[3])}
}

func windowRecord(w *window) recordWindow {
	rw := recordWindow{
		Name: w.name, Secs: w.secs, ByClass: map[string][4]*float64{}, SentEst: w.sentEst,
		Sent: num(w.sent), Recv: num(w.recv), Collectors: w.collectors, Changes: w.changes, Renewals: w.renewals,
		GC: [6]uint64{w.gc.runs, w.gc.failed, w.gc.deleted, w.gc.skipped, w.gc.marked, w.gc.unmarked},
	}
	for _, r := range w.rows {
		rw.Rows = append(rw.Rows, recordRow{r.kind, r.class, r.gc, r.requests, r.events, num(r.sent), num(r.recv), r.sentEst})
	}
	for k, c := range w.byClass {
		rw.ByClass[k] = costRecord(c)
	}
	return rw
}

func windowFrom(rw recordWindow) *window {
	w := &window{
		name: rw.Name, secs: rw.Secs, byClass: map[string]cost{}, sentEst: rw.SentEst,
		sent: fromNum(rw.Sent), recv: fromNum(rw.Recv), collectors: rw.Collectors, changes: rw.Changes, renewals: rw.Renewals,
		gc: gcCounts{rw.GC[0], rw.GC[1], rw.GC[2], rw.GC[3], rw.GC[4], rw.GC[5]},
	}
	for _, r := range rw.Rows {
		w.rows = append(w.rows, kindRow{kind: r.Kind, class: r.Class, gc: r.GC, requests: r.Requests, events: r.Events,
			sent: fromNum(r.Sent), recv: fromNum(r.Recv), sentEst: r.SentEst})
	}
	for k, c := range rw.ByClass {
		w.byClass[k] = costFrom(c)
	}
	if w.sentEst == nil {
		w.sentEst = map[string]bool{}
	}
	return w
}

func recordOf(r *result, cfg config) record {
	return record{
		Mode: r.mode, Nodes: r.nodes, Identities: cfg.identities, Shared: cfg.shared,
		GCInterval: cfg.gcInterval.Seconds(), Churn: cfg.churn,
		Steady: windowRecord(r.steady), ChurnWin: windowRecord(r.churn), GCPer: costRecord(r.gcPer),
		Setup: r.setup.Seconds(), Settle: r.settle.Seconds(), Wall: r.wall.Seconds(), Created: r.created, Peak: r.peak,
		Logged: r.logged, Failed: r.failed, When: time.Now().UTC(),
	}
}

func (rec record) result() *result {
	return &result{
		mode: rec.Mode, nodes: rec.Nodes, steady: windowFrom(rec.Steady), churn: windowFrom(rec.ChurnWin),
		gcPer: costFrom(rec.GCPer), setup: time.Duration(rec.Setup * float64(time.Second)),
		settle: time.Duration(rec.Settle * float64(time.Second)),
		wall:   time.Duration(rec.Wall * float64(time.Second)), created: rec.Created, peak: rec.Peak,
		logged: rec.Logged, failed: rec.Failed,
	}
}

// saveRecord appends r's record to the file path.
func saveRecord(path string, r *result, cfg config) error {
	b, err := json.Marshal(recordOf(r, cfg))
	if err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.Write(append(b, '\n')); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// loadRecords reads the records of the comma-separated files; a later
// record of the same mode and node count replaces an earlier one. The
// configuration is the records' (they must agree on it).
func loadRecords(paths string, cfg config) (map[string][]*result, config, error) {
	out := map[string][]*result{}
	var first *record
	for _, p := range strings.Split(paths, ",") {
		f, err := os.Open(strings.TrimSpace(p))
		if err != nil {
			return nil, cfg, err
		}
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 1<<20), 64<<20)
		for sc.Scan() {
			var rec record
			if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
				f.Close()
				return nil, cfg, fmt.Errorf("%s: %w", p, err)
			}
			if first == nil {
				first = &rec
			} else if rec.Identities != first.Identities || rec.Shared != first.Shared || rec.GCInterval != first.GCInterval || rec.Churn != first.Churn {
				f.Close()
				return nil, cfg, fmt.Errorf("%s: a record of %s mode, %d nodes, was made with other settings than the first", p, rec.Mode, rec.Nodes)
			}
			out[rec.Mode] = append(out[rec.Mode], rec.result())
		}
		err = sc.Err()
		f.Close()
		if err != nil {
			return nil, cfg, err
		}
	}
	if first == nil {
		return nil, cfg, fmt.Errorf("no record in %s", paths)
	}
	cfg.identities, cfg.shared, cfg.churn = first.Identities, first.Shared, first.Churn
	cfg.gcInterval = time.Duration(first.GCInterval * float64(time.Second))
	cfg.modes = nil
	for _, m := range []string{modeEtcd, modeCRD} {
		if len(out[m]) > 0 {
			cfg.modes = append(cfg.modes, m)
		}
	}
	return out, cfg, nil
}
