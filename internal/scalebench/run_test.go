package scalebench

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// window is what one measurement window saw.
type window struct {
	name  string
	secs  float64
	delta snapshot
	// rows by kind, and the costs by class, as the server's counters
	// attribute them (see server.attribute).
	rows    []kindRow
	byClass map[string]cost
	// sentEst marks the classes (and "all") whose sent bytes are in
	// part an estimate.
	sentEst map[string]bool
	// sent and recv are the server's byte totals (NaN: not counted).
	sent, recv float64
	gc         gcCounts
	// collectors is how many nodes ran the collection in the window.
	collectors int
	changes    float64
	renewals   float64
}

// result is one run: one mode, one number of nodes.
type result struct {
	mode    string
	nodes   int
	steady  *window
	churn   *window
	gcPer   cost // a collection run's cost, from the steady window
	setup   time.Duration
	settle  time.Duration
	created int
	wall    time.Duration
	peak    map[string]float64 // process -> peak RSS bytes
	// logged counts the nodes' warnings and errors.
	logged int64
	failed int64 // changes that failed
}

// runOne measures mode with n nodes: it starts the server and the nodes,
// gives each node its identities, then measures a steady window and, after
// a warm-up, a churn window, and stops everything.
func runOne(tb testing.TB, mode string, n int, cfg config, out io.Writer) (*result, error) {
	began := time.Now()
	// The peak memory is this run's: what earlier runs left goes back to
	// the system first.
	debug.FreeOSMemory()
	resetPeakRSS()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	res := &result{mode: mode, nodes: n, peak: map[string]float64{}}
	logs := newCappedLog(os.Stderr, fmt.Sprintf("%s/N=%d", mode, n), 20)

	var srv server
	switch mode {
	case modeEtcd:
		srv = startEtcd(tb, n)
	case modeCRD:
		s, err := startCRD(ctx, tb)
		if err != nil {
			return nil, err
		}
		srv = s
	}
	fmt.Fprintf(out, "\n== %s mode, N=%d: %s\n", mode, n, srv.describe())

	nodes := make([]*node, n)
	idx := make([]*node, n)
	for i := range idx {
		idx[i] = &node{index: i}
	}
	// The nodes start spread over one collection interval, as agents
	// start at different moments: each node's timers (its collection,
	// its renewals) take their phase from its start, and nodes whose
	// collections ran at the same instant would all race for the same
	// marks and deletes.
	startCtx, startCancel := context.WithTimeout(ctx, 10*time.Minute)
	spreadFrom := time.Now()
	err := forEach(idx, 8, func(p *node) error {
		sleep(startCtx, time.Until(spreadFrom.Add(time.Duration(p.index)*cfg.gcInterval/time.Duration(n))))
		nd, err := srv.startNode(startCtx, logs.logger(nodeName(p.index)), p.index, cfg)
		if err != nil {
			return err
		}
		nodes[p.index] = nd
		return nil
	})
	startCancel()
	defer func() {
		// Stops every node that started, whatever failed.
		var started []*node
		for _, nd := range nodes {
			if nd != nil {
				started = append(started, nd)
			}
		}
		sctx, scancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer scancel()
		if err := forEach(started, 16, func(nd *node) error { return nd.stop(sctx) }); err != nil {
			fmt.Fprintf(out, "   stopping the nodes: %v\n", err)
		}
	}()
	if err != nil {
		return nil, err
	}

	setupStart := time.Now()
	allocCtx, allocCancel := context.WithTimeout(ctx, 20*time.Minute)
	err = forEach(nodes, 16, func(nd *node) error { return nd.allocateInitial(allocCtx, cfg) })
	allocCancel()
	if err != nil {
		return nil, err
	}
	res.setup = time.Since(setupStart)
	res.created = n*(cfg.identities-cfg.shared) + cfg.shared
	fmt.Fprintf(out, "   %d nodes started and holding %d identities each (%d shared by all, %d of its own): %d identities, set up in %s\n",
		n, cfg.identities, cfg.shared, cfg.identities-cfg.shared, res.created, res.setup.Round(100*time.Millisecond))

	res.settle = settle(ctx, nodes, cfg)

	res.steady, err = measure(ctx, srv, nodes, "steady", cfg.window, nil)
	if err != nil {
		return nil, err
	}
	if err := srv.afterSteady(ctx); err != nil {
		return nil, err
	}

	ch := startChurn(ctx, nodes, cfg.churn)
	sleep(ctx, cfg.warmupFor(mode))
	res.churn, err = measure(ctx, srv, nodes, "churn", cfg.window, ch)
	// What the nodes log from here on is the stop's: requests the stop
	// cancels.
	logs.mute()
	ch.stop()
	res.failed = ch.failed.Load()
	if err != nil {
		return nil, err
	}
	if err := srv.afterChurn(ctx); err != nil {
		return nil, err
	}
	for _, w := range []*window{res.steady, res.churn} {
		srv.attribute(w)
	}
	if res.steady.gc.runs > 0 {
		res.gcPer = srv.gcCost(res.steady).times(1 / float64(res.steady.gc.runs))
	}
	res.peak["bench process"] = peakRSS("self")
	for name, pid := range srv.pids() {
		res.peak[name] = peakRSS(strconv.Itoa(pid))
	}
	res.logged = logs.count.Load()
	res.wall = time.Since(began)
	printRun(out, res, srv, cfg)
	return res, nil
}

// settle waits after the setup until the nodes' collections have been
// quiet (no delete, skipped delete or mark) for one collection interval, at
// least settleFor() and at most 10 minutes: a collection run that began
// during the setup's burst of creates finds every identity created after
// its listing a candidate, and its paced delete attempts can go on for
// minutes after the setup.
func settle(ctx context.Context, nodes []*node, cfg config) time.Duration {
	start := time.Now()
	if cfg.settle > 0 {
		sleep(ctx, cfg.settle)
		return time.Since(start)
	}
	activity := func() uint64 {
		var t uint64
		for _, nd := range nodes {
			g := nd.gc()
			t += g.deleted + g.skipped + g.marked + g.unmarked + g.failed
		}
		return t
	}
	last, quietSince := activity(), time.Now()
	for ctx.Err() == nil {
		sleep(ctx, time.Second)
		if a := activity(); a != last {
			last, quietSince = a, time.Now()
		}
		took := time.Since(start)
		if took >= cfg.settleFor() && time.Since(quietSince) >= cfg.gcInterval || took >= 10*time.Minute {
			break
		}
	}
	return time.Since(start)
}

// slips reports where the machine did not keep pace with a run's timers or
// its churn: on two cores the nodes, the server and the benchmark share the
// processors, and past some N the timers slip. steady is what slipped in
// the steady window, on whose costs per renewal and per collection run the
// extrapolation builds: such a run is left out of its fits. churn is what
// slipped under churn, which the costs per change and per run absorb: it
// is only reported.
func slips(r *result, cfg config) (steady, churn []string) {
	n := float64(r.nodes)
	if nominal := n * r.steady.secs / (leaseTTL / 3).Seconds(); r.steady.renewals < 0.9*nominal {
		steady = append(steady, fmt.Sprintf("%.0f renewals in the steady window, of %.0f", r.steady.renewals, nominal))
	}
	if w := r.steady; w.collectors > 0 {
		if per, nominal := float64(w.gc.runs)/float64(w.collectors), w.secs/cfg.gcInterval.Seconds(); per < 0.9*nominal {
			steady = append(steady, fmt.Sprintf("%.2g GC runs per collector in the steady window, of %.2g", per, nominal))
		}
	}
	if rate := r.churn.changes / r.churn.secs / n; rate < 0.95*cfg.churn {
		churn = append(churn, fmt.Sprintf("churn at %.3g/s per node of %.3g", rate, cfg.churn))
	}
	if s, c := r.steady.gc.runs, r.churn.gc.runs; s > 0 && float64(c) < 0.9*float64(s) {
		churn = append(churn, fmt.Sprintf("GC runs fell from %d in the steady window to %d under churn", s, c))
	}
	if r.steady.renewals > 0 && r.churn.renewals > 0 {
		s := r.steady.byClass[classRefs].requests / r.steady.renewals
		c := r.churn.byClass[classRefs].requests / r.churn.renewals
		if c < 0.95*s {
			churn = append(churn, fmt.Sprintf("refs+GC requests per renewal fell from %.3g in the steady window to %.3g under churn", s, c))
		}
	}
	return steady, churn
}

// paceNote is what slipped in a run: in the steady window (the run is
// left out of the extrapolation), and under churn.
type paceNote struct{ steady, churn string }

// pace applies slips to a mode's runs, ordered by N, and one check across
// them: a node's periodic work per renewal does not shrink as the cluster
// grows, so refs+GC requests per renewal in the steady window more than 5%
// below the last smaller N's mean that the nodes' timers slipped.
func pace(rs []*result, cfg config) map[*result]paceNote {
	out := map[*result]paceNote{}
	var prev *result
	for _, r := range rs {
		steady, churn := slips(r, cfg)
		if prev != nil && prev.steady.renewals > 0 && r.steady.renewals > 0 {
			p := prev.steady.byClass[classRefs].requests / prev.steady.renewals
			c := r.steady.byClass[classRefs].requests / r.steady.renewals
			if c < 0.95*p {
				steady = append(steady, fmt.Sprintf("refs+GC requests per renewal fell from %.3g at N=%d to %.3g", p, prev.nodes, c))
			}
		}
		out[r] = paceNote{strings.Join(steady, "; "), strings.Join(churn, "; ")}
		if len(steady) == 0 {
			prev = r
		}
	}
	return out
}

// measure scrapes the server and the nodes' collection counters before and
// after d.
func measure(ctx context.Context, srv server, nodes []*node, name string, d time.Duration, ch *churn) (*window, error) {
	gcBefore := make([]gcCounts, len(nodes))
	for i, nd := range nodes {
		gcBefore[i] = nd.gc()
	}
	var changes0 int64
	if ch != nil {
		changes0 = ch.done.Load()
	}
	before, err := srv.scrape(ctx)
	if err != nil {
		return nil, err
	}
	start := time.Now()
	sleep(ctx, d)
	after, err := srv.scrape(ctx)
	if err != nil {
		return nil, err
	}
	w := &window{name: name, secs: time.Since(start).Seconds(), delta: delta(before, after)}
	if ch != nil {
		w.changes = float64(ch.done.Load() - changes0)
	}
	for i, nd := range nodes {
		g := nd.gc().minus(gcBefore[i])
		w.gc.runs += g.runs
		w.gc.failed += g.failed
		w.gc.deleted += g.deleted
		w.gc.skipped += g.skipped
		w.gc.marked += g.marked
		w.gc.unmarked += g.unmarked
		if g.runs > 0 {
			w.collectors++
		}
	}
	w.renewals = srv.renewals(w.delta)
	return w, ctx.Err()
}

// churn makes changes on the nodes in turn at rate per node: every
// 1/(rate*N) seconds the next node releases its oldest own label set and
// allocates a new one.
type churn struct {
	cancel       context.CancelFunc
	wg           sync.WaitGroup
	done, failed atomic.Int64
}

func startChurn(ctx context.Context, nodes []*node, rate float64) *churn {
	ctx, cancel := context.WithCancel(ctx)
	c := &churn{cancel: cancel}
	every := time.Duration(float64(time.Second) / (rate * float64(len(nodes))))
	c.wg.Go(func() {
		t := time.NewTicker(every)
		defer t.Stop()
		for i := 0; ; i++ {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			nd := nodes[i%len(nodes)]
			c.wg.Go(func() {
				cctx, ccancel := context.WithTimeout(ctx, 2*time.Minute)
				defer ccancel()
				if err := nd.change(cctx); err != nil {
					if ctx.Err() == nil {
						c.failed.Add(1)
						nd.log.Error("Change failed", "error", err)
					}
					return
				}
				c.done.Add(1)
			})
		}
	})
	return c
}

func (c *churn) stop() {
	c.cancel()
	c.wg.Wait()
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// cappedLog prints the nodes' warnings and errors, the first max of a run,
// and counts them all.
type cappedLog struct {
	w      io.Writer
	prefix string
	max    int64
	count  atomic.Int64
	muted  atomic.Bool
	mu     sync.Mutex
}

// mute drops what is logged from now on.
func (c *cappedLog) mute() { c.muted.Store(true) }

func newCappedLog(w io.Writer, prefix string, max int64) *cappedLog {
	return &cappedLog{w: w, prefix: prefix, max: max}
}

func (c *cappedLog) logger(node string) *slog.Logger {
	return slog.New(&cappedHandler{c: c, node: node})
}

type cappedHandler struct {
	c     *cappedLog
	node  string
	attrs []slog.Attr
}

func (h *cappedHandler) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelWarn }

func (h *cappedHandler) Handle(_ context.Context, r slog.Record) error {
	if h.c.muted.Load() {
		return nil
	}
	n := h.c.count.Add(1)
	if n > h.c.max {
		return nil
	}
	h.c.mu.Lock()
	defer h.c.mu.Unlock()
	fmt.Fprintf(h.c.w, "   [%s %s] %s %s", h.c.prefix, h.node, r.Level, r.Message)
	attrs := append([]slog.Attr(nil), h.attrs...)
	r.Attrs(func(a slog.Attr) bool { attrs = append(attrs, a); return true })
	for _, a := range attrs {
		fmt.Fprintf(h.c.w, " %s=%v", a.Key, a.Value)
	}
	fmt.Fprintln(h.c.w)
	if n == h.c.max {
		fmt.Fprintf(h.c.w, "   [%s] further warnings and errors are counted, not shown\n", h.c.prefix)
	}
	return nil
}

func (h *cappedHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &cappedHandler{c: h.c, node: h.node, attrs: append(append([]slog.Attr(nil), h.attrs...), as...)}
}

func (h *cappedHandler) WithGroup(string) slog.Handler { return h }
