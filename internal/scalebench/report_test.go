package scalebench

import (
	"fmt"
	"io"
	"maps"
	"math"
	"slices"
	"sort"
	"strings"
	"time"
)

// si formats v with three significant digits and an SI prefix.
func si(v float64) string {
	switch {
	case math.IsNaN(v):
		return "-"
	case v == 0:
		return "0"
	}
	a := math.Abs(v)
	for _, u := range []struct {
		f float64
		s string
	}{{1e9, "G"}, {1e6, "M"}, {1e3, "k"}} {
		if a >= u.f*0.9995 {
			return sig3(v/u.f) + u.s
		}
	}
	return sig3(v)
}

// est prefixes an estimate with "~".
func est(s string, estimated bool) string {
	if estimated && s != "-" && s != "0" {
		return "~" + s
	}
	return s
}

func sig3(v float64) string {
	a := math.Abs(v)
	switch {
	case a >= 99.95:
		return fmt.Sprintf("%.0f", v)
	case a >= 9.995:
		return fmt.Sprintf("%.1f", v)
	case a >= 0.9995:
		return fmt.Sprintf("%.2f", v)
	case a >= 0.0995:
		return fmt.Sprintf("%.3f", v)
	}
	return fmt.Sprintf("%.2g", v)
}

func classRank(c string) int { return slices.Index(classes, c) }

// sortedRows orders rows by class, then kind.
func sortedRows(rows []kindRow) []kindRow {
	out := slices.Clone(rows)
	sort.Slice(out, func(i, j int) bool {
		if a, b := classRank(out[i].class), classRank(out[j].class); a != b {
			return a < b
		}
		return out[i].kind < out[j].kind
	})
	return out
}

// printRun prints one run's windows.
func printRun(out io.Writer, r *result, srv server, cfg config) {
	n := float64(r.nodes)
	fmt.Fprintf(out, "   timers: GC every %s; leases %s (renewed every %s); etcd periodic sync every %s; CRD heartbeat timeout %s\n",
		cfg.gcInterval, leaseTTL, syncInterval.Round(100*time.Millisecond), syncInterval.Round(100*time.Millisecond), heartbeat)
	fmt.Fprintf(out, "   steady window %.1fs; churn window %.1fs after %s of churn: %.0f changes (%.3f/s per node), %d failed\n",
		r.steady.secs, r.churn.secs, cfg.warmupFor(r.mode), r.churn.changes, r.churn.changes/r.churn.secs/n, r.failed)
	fmt.Fprintf(out, "   %-7s %-8s %-36s %9s %9s %9s %9s %10s %10s\n", "window", "class", "kind", "req/s", "/node", "events/s", "/node", "sent B/s", "recv B/s")
	for _, w := range []*window{r.steady, r.churn} {
		for _, row := range sortedRows(w.rows) {
			fmt.Fprintf(out, "   %-7s %-8s %-36s %9s %9s %9s %9s %10s %10s\n", w.name, row.class, row.kind,
				si(row.requests/w.secs), si(row.requests/w.secs/n), si(row.events/w.secs), si(row.events/w.secs/n),
				est(si(row.sent/w.secs), row.sentEst), si(row.recv/w.secs))
		}
		for _, c := range classes {
			k := w.byClass[c]
			fmt.Fprintf(out, "   %-7s %-8s %-36s %9s %9s %9s %9s %10s %10s\n", w.name, c, "(class total)",
				si(k.requests/w.secs), si(k.requests/w.secs/n), si(k.events/w.secs), si(k.events/w.secs/n), est(si(k.sent/w.secs), w.sentEst[c]), si(k.recv/w.secs))
		}
		fmt.Fprintf(out, "   %-7s %-8s %-36s %9s %9s %9s %9s %10s %10s\n", w.name, "all", "(all kinds)", "", "", "", "", est(si(w.sent/w.secs), w.sentEst["all"]), si(w.recv/w.secs))
	}
	fmt.Fprintf(out, "   bytes: %s\n", srv.bytesNote())
	for _, w := range []*window{r.steady, r.churn} {
		fmt.Fprintf(out, "   GC in the %s window: %d runs by %d of %d nodes (%d failed); %d identities deleted, %d deletes skipped",
			w.name, w.gc.runs, w.collectors, r.nodes, w.gc.failed, w.gc.deleted, w.gc.skipped)
		if r.mode == modeCRD {
			fmt.Fprintf(out, ", %d marked, %d unmarked", w.gc.marked, w.gc.unmarked)
		}
		fmt.Fprintln(out)
	}
	fmt.Fprintf(out, "   a GC run (steady window): %s requests, %s B sent, %s B received; %.0f renewals in the steady window (%s)\n",
		si(r.gcPer.requests), si(r.gcPer.sent), si(r.gcPer.recv), r.steady.renewals, renewalUnit(r.mode))
	var peaks []string
	for _, name := range slices.Sorted(maps.Keys(r.peak)) {
		peaks = append(peaks, fmt.Sprintf("%s %sB", name, si(r.peak[name])))
	}
	fmt.Fprintf(out, "   peak RSS: %s; run took %s (setup %s, then %s until the collections were quiet); the nodes logged %d warnings and errors\n",
		strings.Join(peaks, ", "), r.wall.Round(time.Second), r.setup.Round(100*time.Millisecond), r.settle.Round(time.Second), r.logged)
	steady, churn := slips(r, cfg)
	if len(steady) > 0 {
		fmt.Fprintf(out, "   SLIPPED in the steady window: %s; the extrapolation leaves this run out\n", strings.Join(steady, "; "))
	}
	if len(churn) > 0 {
		fmt.Fprintf(out, "   SLIPPED under churn: %s (normalized per change and per run; reported only)\n", strings.Join(churn, "; "))
	}
}

func renewalUnit(mode string) string {
	if mode == modeCRD {
		return "IdentityNode PATCHes"
	}
	return "LeaseKeepAlive messages"
}

// extraGCRequests is what the collection's runs of the churn window sent
// beyond their steady cost per run and the marks and deletes that
// succeeded. The etcd store counts its delete transactions that found the
// key referenced or changed; the CRD store's requests are the server's
// counts of the collection's kinds.
func extraGCRequests(r *result) float64 {
	c := r.churn
	if r.mode == modeEtcd {
		return float64(c.gc.skipped)
	}
	var sent float64
	for _, row := range c.rows {
		if row.gc {
			sent += row.requests
		}
	}
	done := float64(c.gc.deleted + c.gc.marked + c.gc.unmarked)
	return max(sent-r.gcPer.requests*float64(c.gc.runs)-done, 0)
}

// fitCosts is the least-squares line y = a + b·x with a, b ≥ 0, or the
// mean when the slope is noise: a cost per unit does not fall as the
// cluster grows, and the extrapolation multiplies a slope by thousands, so
// a slope below zero, under two standard errors, or adding less than a
// tenth over the measured range is taken as none.
func fitCosts(x, y []float64) (a, b float64) {
	a, b = fitLine(x, y)
	mean := func() (float64, float64) {
		var sy float64
		for _, v := range y {
			sy += v
		}
		return max(sy/float64(len(y)), 0), 0
	}
	xmax := slices.Max(x)
	if b <= 0 || b*xmax < 0.1*(a+b*xmax) {
		return mean()
	}
	if n := float64(len(x)); n >= 3 {
		var sx, res, sxx float64
		for i := range x {
			sx += x[i]
		}
		for i := range x {
			d := y[i] - a - b*x[i]
			res += d * d
			sxx += (x[i] - sx/n) * (x[i] - sx/n)
		}
		if sxx > 0 && b < 2*math.Sqrt(res/(n-2)/sxx) {
			return mean()
		}
	}
	if a < 0 {
		var sxy, sxx float64
		for i := range x {
			sxy += x[i] * y[i]
			sxx += x[i] * x[i]
		}
		if sxx > 0 {
			return 0, max(sxy/sxx, 0)
		}
		return 0, 0
	}
	return a, b
}

// fitLine is the least-squares line y = a + b·x; with one point, the
// constant.
func fitLine(x, y []float64) (a, b float64) {
	n := float64(len(x))
	if len(x) == 1 {
		return y[0], 0
	}
	var sx, sy, sxx, sxy float64
	for i := range x {
		sx += x[i]
		sy += y[i]
		sxx += x[i] * x[i]
		sxy += x[i] * y[i]
	}
	den := n*sxx - sx*sx
	if den == 0 {
		return sy / n, 0
	}
	b = (n*sxy - sx*sy) / den
	return (sy - b*sx) / n, b
}

// exponent is the least-squares slope of log(y) over log(x), over the
// points with y > 0; NaN with fewer than two.
func exponent(x, y []float64) float64 {
	var lx, ly []float64
	for i := range x {
		if y[i] > 0 && !math.IsNaN(y[i]) {
			lx = append(lx, math.Log(x[i]))
			ly = append(ly, math.Log(y[i]))
		}
	}
	if len(lx) < 2 {
		return math.NaN()
	}
	_, b := fitLine(lx, ly)
	return b
}

func fmtExp(e float64) string {
	if math.IsNaN(e) {
		return "-"
	}
	return fmt.Sprintf("%.2f", e)
}

// printSummary prints one mode's rates by N, with their exponents.
func printSummary(out io.Writer, mode string, rs []*result, cfg config) {
	if len(rs) == 0 {
		return
	}
	xs := make([]float64, len(rs))
	head := fmt.Sprintf("   %-7s %-8s %-36s %-9s", "window", "class", "kind", "measure")
	slow := pace(rs, cfg)
	for i, r := range rs {
		xs[i] = float64(r.nodes)
		mark := ""
		switch {
		case slow[r].steady != "":
			mark = "*"
		case slow[r].churn != "":
			mark = "+"
		}
		head += fmt.Sprintf(" %17s", fmt.Sprintf("N=%d%s", r.nodes, mark))
	}
	fmt.Fprintf(out, "\n== %s mode: rates at the server by N (per node in parentheses); exp = least-squares slope of log(total) over log(N), over the runs that kept pace in the window (no *; under churn no + either)\n", mode)
	for _, r := range rs {
		if why := slow[r].steady; why != "" {
			fmt.Fprintf(out, "   * N=%d: the machine did not keep pace in the steady window (left out of the extrapolation): %s\n", r.nodes, why)
		}
		if why := slow[r].churn; why != "" {
			fmt.Fprintf(out, "   %s N=%d: the machine did not keep pace under churn: %s\n", map[bool]string{true: "*", false: "+"}[slow[r].steady != ""], r.nodes, why)
		}
	}
	fmt.Fprintln(out, head+"    exp")
	line := func(win, class, kind, measure string, vals []float64, estimated ...bool) {
		s := fmt.Sprintf("   %-7s %-8s %-36s %-9s", win, class, kind, measure)
		var px, pv []float64
		for i, v := range vals {
			e := i < len(estimated) && estimated[i]
			s += fmt.Sprintf(" %17s", est(si(v), e)+" ("+si(v/xs[i])+")")
			if p := slow[rs[i]]; p.steady == "" && (win != "churn" || p.churn == "") {
				px, pv = append(px, xs[i]), append(pv, v)
			}
		}
		fmt.Fprintln(out, s+"  "+fmtExp(exponent(px, pv)))
	}
	for _, which := range []string{"steady", "churn"} {
		pick := func(r *result) *window {
			if which == "steady" {
				return r.steady
			}
			return r.churn
		}
		// Every kind any run saw, in class order.
		seen := map[string]kindRow{}
		for _, r := range rs {
			for _, row := range pick(r).rows {
				seen[row.kind] = row
			}
		}
		var kinds []kindRow
		for _, row := range seen {
			kinds = append(kinds, row)
		}
		for _, k := range sortedRows(kinds) {
			get := func(f func(kindRow) float64) []float64 {
				vals := make([]float64, len(rs))
				for i, r := range rs {
					w := pick(r)
					for _, row := range w.rows {
						if row.kind == k.kind {
							vals[i] = f(row) / w.secs
						}
					}
				}
				return vals
			}
			if k.events > 0 || strings.HasPrefix(k.kind, "watch events") {
				ests := make([]bool, len(rs))
				for i, r := range rs {
					for _, row := range pick(r).rows {
						if row.kind == k.kind {
							ests[i] = row.sentEst
						}
					}
				}
				line(which, k.class, k.kind, "events/s", get(func(r kindRow) float64 { return r.events }))
				line(which, k.class, k.kind, "sent B/s", get(func(r kindRow) float64 { return r.sent }), ests...)
				continue
			}
			line(which, k.class, k.kind, "req/s", get(func(r kindRow) float64 { return r.requests }))
		}
		for _, c := range classes[:2] {
			for _, m := range []struct {
				name string
				f    func(cost) float64
			}{
				{"req/s", func(c cost) float64 { return c.requests }},
				{"events/s", func(c cost) float64 { return c.events }},
				{"sent B/s", func(c cost) float64 { return c.sent }},
				{"recv B/s", func(c cost) float64 { return c.recv }},
			} {
				vals := make([]float64, len(rs))
				ests := make([]bool, len(rs))
				for i, r := range rs {
					w := pick(r)
					vals[i] = m.f(w.byClass[c]) / w.secs
					ests[i] = m.name == "sent B/s" && w.sentEst[c]
				}
				line(which, c, "(class total)", m.name, vals, ests...)
			}
		}
		sent := make([]float64, len(rs))
		recv := make([]float64, len(rs))
		ests := make([]bool, len(rs))
		for i, r := range rs {
			w := pick(r)
			sent[i], recv[i], ests[i] = w.sent/w.secs, w.recv/w.secs, w.sentEst["all"]
		}
		line(which, "all", "(all kinds)", "sent B/s", sent, ests...)
		line(which, "all", "(all kinds)", "recv B/s", recv)
		s := fmt.Sprintf("   %-7s %-8s %-36s %-9s", which, "GC", "nodes that ran a collection", "")
		for _, r := range rs {
			w := pick(r)
			s += fmt.Sprintf(" %17s", fmt.Sprintf("%d of %d", w.collectors, r.nodes))
		}
		fmt.Fprintln(out, s)
		vals := make([]float64, len(rs))
		for i, r := range rs {
			vals[i] = float64(pick(r).gc.runs) / pick(r).secs
		}
		line(which, "GC", "runs", "runs/s", vals)
	}
}

// units are one run's costs per unit, the inputs of the extrapolation.
type units struct {
	nodes float64
	// gcRun is a collection run's refs+GC cost; renewal is the rest of
	// the steady refs+GC cost per renewal.
	gcRun, renewal cost
	// change is a change's cost by class: the churn window's rate over
	// the steady window's, per change.
	change map[string]cost
	// steadyEvents is the steady window's events cost per node and
	// second, which no timer of the store scales.
	steadyEvents cost
	// collectors is the number of collection runs per collection
	// interval; skipped the delete attempts in vain per run under churn.
	collectors, skipped float64
}

func unitsOf(r *result, cfg config) units {
	s, c := r.steady, r.churn
	u := units{nodes: float64(r.nodes), gcRun: r.gcPer, change: map[string]cost{}}
	if s.renewals > 0 {
		u.renewal = s.byClass[classRefs].minus(r.gcPer.times(float64(s.gc.runs))).times(1 / s.renewals)
	}
	// What the collection's runs send under churn beyond their steady
	// cost and the one mark and one delete each released identity
	// needs (marks and deletes another collector made first, candidates
	// created after the run's listing, longer listings) is the runs'
	// cost: per run it depends on the churn, not on the interval, so it
	// goes with the runs, not with the changes.
	extra := extraGCRequests(r)
	if c.gc.runs > 0 {
		u.skipped = extra / float64(c.gc.runs)
	}
	// A change's cost is what the churn window cost beyond the steady
	// one. The runs' steady cost comes off each window first: the
	// windows need not hold the same number of runs, and at large N a
	// run's listing outweighs many changes.
	for _, k := range classes[:2] {
		sc, cc := s.byClass[k], c.byClass[k]
		if k == classRefs {
			sc = sc.minus(r.gcPer.times(float64(s.gc.runs)))
			cc = cc.minus(r.gcPer.times(float64(c.gc.runs)))
			cc.requests -= extra
		}
		extra := cc.times(1 / c.secs).minus(sc.times(1 / s.secs))
		if c.changes > 0 {
			u.change[k] = extra.times(c.secs / c.changes)
		}
	}
	u.steadyEvents = s.byClass[classEvents].times(1 / s.secs / u.nodes)
	u.collectors = float64(s.gc.runs) / (s.secs / cfg.gcInterval.Seconds())
	return u
}

// fitCost fits each measure of f(units) as a + b·N.
type costLine struct{ a, b cost }

func fitCost(us []units, f func(units) cost) costLine {
	x := make([]float64, len(us))
	for i, u := range us {
		x[i] = u.nodes
	}
	measure := func(g func(cost) float64) (float64, float64) {
		y := make([]float64, len(us))
		for i, u := range us {
			y[i] = g(f(u))
			if math.IsNaN(y[i]) {
				y[i] = 0
			}
		}
		return fitCosts(x, y)
	}
	var l costLine
	l.a.requests, l.b.requests = measure(func(c cost) float64 { return c.requests })
	l.a.events, l.b.events = measure(func(c cost) float64 { return c.events })
	l.a.sent, l.b.sent = measure(func(c cost) float64 { return c.sent })
	l.a.recv, l.b.recv = measure(func(c cost) float64 { return c.recv })
	return l
}

// at evaluates the line at n, no measure below 0.
func (l costLine) at(n float64) cost {
	c := l.a.plus(l.b.times(n))
	return cost{max(c.requests, 0), max(c.events, 0), max(c.sent, 0), max(c.recv, 0)}
}

func (l costLine) String() string {
	f := func(a, b float64) string { return si(a) + " + " + si(b) + "·N" }
	return fmt.Sprintf("req %s; events %s; sent %s B; recv %s B", f(l.a.requests, l.b.requests), f(l.a.events, l.b.events), f(l.a.sent, l.b.sent), f(l.a.recv, l.b.recv))
}

// printExtrapolation prints one mode's extrapolation to 1,000 and 5,000
// nodes at the defaults.
func printExtrapolation(out io.Writer, mode string, rs []*result, cfg config) {
	if len(rs) < 2 {
		fmt.Fprintf(out, "\n== EXTRAPOLATION of %s mode: needs at least two node counts\n", mode)
		return
	}
	// The costs per run and per renewal come from the steady window,
	// those per change (and a run's extra under churn) from the churn
	// window: each is fitted over the runs in which the machine kept
	// pace in the windows it comes from.
	slow := pace(rs, cfg)
	var steadyRuns, churnRuns []*result
	for _, r := range rs {
		if slow[r].steady == "" {
			steadyRuns = append(steadyRuns, r)
			if slow[r].churn == "" {
				churnRuns = append(churnRuns, r)
			}
		}
	}
	var notes []string
	if len(steadyRuns) < 2 {
		notes = append(notes, "fewer than two runs kept pace in the steady window: the fits use all runs")
		steadyRuns = rs
	}
	if len(churnRuns) < 2 {
		notes = append(notes, "fewer than two runs kept pace under churn: the costs per change use the runs of the steady window's fits")
		churnRuns = steadyRuns
	}
	nodesOf := func(rs []*result) string {
		var ns []string
		for _, r := range rs {
			ns = append(ns, fmt.Sprint(r.nodes))
		}
		return strings.Join(ns, ", ")
	}
	unitsFor := func(rs []*result) []units {
		us := make([]units, len(rs))
		for i, r := range rs {
			us[i] = unitsOf(r, cfg)
		}
		return us
	}
	us, uc := unitsFor(steadyRuns), unitsFor(churnRuns)
	gcRun := fitCost(us, func(u units) cost { return u.gcRun })
	renewal := fitCost(us, func(u units) cost { return u.renewal })
	steadyEvents := fitCost(us, func(u units) cost { return u.steadyEvents })
	changeRefs := fitCost(uc, func(u units) cost { return u.change[classRefs] })
	changeEvents := fitCost(uc, func(u units) cost { return u.change[classEvents] })
	x := make([]float64, len(us))
	y := make([]float64, len(us))
	for i, u := range us {
		x[i], y[i] = u.nodes, u.collectors
	}
	colA, colB := fitCosts(x, y)
	xc := make([]float64, len(uc))
	sk := make([]float64, len(uc))
	for i, u := range uc {
		xc[i], sk[i] = u.nodes, u.skipped
	}
	skA, skB := fitCosts(xc, sk)
	note := ""
	for _, n := range notes {
		note += "   NOTE: " + n + "\n"
	}
	note += fmt.Sprintf("   fitted over N = %s (a GC run, a renewal, collectors); N = %s (a change, a run's extra under churn)\n", nodesOf(steadyRuns), nodesOf(churnRuns))
	renewEvery := defaultLeaseTTL / 3

	fmt.Fprintf(out, "\n== EXTRAPOLATION, not a measurement: %s mode at 1,000 and 5,000 nodes, at the defaults\n", mode)
	fmt.Fprintf(out, "   defaults: GC every %s; leases %s renewed every %s", defaultGCInterval, defaultLeaseTTL, renewEvery)
	if mode == modeEtcd {
		fmt.Fprintf(out, ", periodic sync every %s", defaultSync)
	} else {
		fmt.Fprintf(out, " (--identity-node-lease-ttl %s)", defaultNodeLease)
	}
	fmt.Fprintf(out, "; %d identities per node (as measured; %d shared); %.2g changes/s per node\n", cfg.identities, cfg.shared, defaultChurn)
	if defaultSync != renewEvery || defaultNodeLease != defaultLeaseTTL {
		fmt.Fprintf(out, "   NOTE: the defaults no longer share one renewal period (sync %s, node lease %s): the per-renewal unit below mixes them\n", defaultSync, defaultNodeLease)
	}
	fmt.Fprint(out, note)
	fmt.Fprintln(out, "   method: costs per unit, each fitted as a + b·N (least squares, a, b ≥ 0; a slope under two standard errors or adding less than a tenth over the fitted N is dropped); rate = units per second at the defaults × cost per unit at that N")
	fmt.Fprintf(out, "     a GC run (refs+GC kinds of the collection, steady window, per run):   %s\n", gcRun)
	fmt.Fprintf(out, "     a renewal (the rest of steady refs+GC, per %s): %s\n", renewalUnit(mode), renewal)
	fmt.Fprintf(out, "     a GC run's extra requests under churn (marks and deletes another collector made first, candidates newer than its listing, longer listings): %s + %s·N\n", si(skA), si(skB))
	fmt.Fprintf(out, "     a change, refs+GC (churn window over steady, those extra requests left out, per change): %s\n", changeRefs)
	fmt.Fprintf(out, "     a change, events:                                         %s\n", changeEvents)
	fmt.Fprintf(out, "     events in the steady window, per node and second (not scaled): %s\n", steadyEvents)
	fmt.Fprintf(out, "     collection runs per GC interval: %.3g + %.3g·N (measured: %s)\n", colA, colB, collectorsText(us))
	fmt.Fprintf(out, "   %-6s %-32s %11s %11s %11s %11s\n", "N", "measured per unit", "requests", "events", "sent B", "recv B")
	for _, r := range rs {
		u := unitsOf(r, cfg)
		mark := ""
		switch {
		case slow[r].steady != "":
			mark = "*"
		case slow[r].churn != "":
			mark = "+"
		}
		for _, p := range []struct {
			name string
			c    cost
		}{
			{"a GC run", u.gcRun}, {"a renewal", u.renewal}, {"a change, refs+GC", u.change[classRefs]}, {"a change, events", u.change[classEvents]},
		} {
			fmt.Fprintf(out, "   %-6s %-32s %11s %11s %11s %11s\n", fmt.Sprint(r.nodes)+mark, p.name, si(p.c.requests), si(p.c.events), si(p.c.sent), si(p.c.recv))
		}
	}
	fmt.Fprintf(out, "   %-6s %-32s %11s %11s %11s %11s\n", "nodes", "part (extrapolated)", "req/s", "events/s", "sent B/s", "recv B/s")
	row := func(nodes int, part string, c cost) {
		fmt.Fprintf(out, "   %-6d %-32s %11s %11s %11s %11s\n", nodes, part, si(c.requests), si(c.events), si(c.sent), si(c.recv))
	}
	for _, nt := range []int{targetSmall, targetLarge} {
		n := float64(nt)
		runs := max(colA+colB*n, 1) / defaultGCInterval.Seconds()
		gc := gcRun.at(n).times(runs)
		gc.requests += (skA + skB*n) * runs
		ren := renewal.at(n).times(n / renewEvery.Seconds())
		chRefs := changeRefs.at(n).times(defaultChurn * n)
		chEvents := changeEvents.at(n).times(defaultChurn * n)
		stEvents := steadyEvents.at(n).times(n)
		refs := gc.plus(ren).plus(chRefs)
		collectors := runs * defaultGCInterval.Seconds()
		plural := "s"
		if math.Round(collectors) == 1 {
			plural = ""
		}
		row(nt, fmt.Sprintf("refs+GC: GC (%.0f collector%s)", collectors, plural), gc)
		row(nt, "refs+GC: renewals", ren)
		row(nt, "refs+GC: changes", chRefs)
		row(nt, "refs+GC: total", refs)
		row(nt, "events: changes", chEvents)
		row(nt, "events: steady", stEvents)
		row(nt, "all", refs.plus(chEvents).plus(stEvents))
		if nt == targetLarge {
			one := gcRun.at(n).times(1 / defaultGCInterval.Seconds())
			one.requests += (skA + skB*n) / defaultGCInterval.Seconds()
			maint := gc.plus(ren)
			row(nt, "one collector's GC alone", one)
			fmt.Fprintf(out, "   %d nodes: GC + reference maintenance (GC runs and renewals; changes not included) against one collector's GC: %s in requests, %s in bytes sent, %s in bytes received (acceptance: at most 2x)\n",
				nt, ratio(maint.requests, one.requests), ratio(maint.sent, one.sent), ratio(maint.recv, one.recv))
		}
	}
}

func ratio(a, b float64) string {
	if b <= 0 || math.IsNaN(a) || math.IsNaN(b) {
		return "-"
	}
	return si(a/b) + "x"
}

func collectorsText(us []units) string {
	var s []string
	for _, u := range us {
		s = append(s, fmt.Sprintf("%.2g at N=%.0f", u.collectors, u.nodes))
	}
	return strings.Join(s, ", ")
}
