package allocator

import (
	"fmt"
	"log/slog"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/hive/cell"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/identity"
)

// spaceForecastWindow is the window over which the net creation rate of
// the exhaustion forecast is measured.
const spaceForecastWindow = 5 * time.Minute

// spaceLevel is the state of the global ID range that health and the log
// report: each change is logged once.
type spaceLevel int

const (
	spaceOK spaceLevel = iota
	// spaceHigh: at least globalstore.SpaceWarnRatio of the range is in use.
	spaceHigh
	// spaceExhausted: every ID is in use, or the store refused an
	// allocation for want of one and no ID was taken or freed since.
	spaceExhausted
)

// spaceWatch follows how much of this cluster's global ID range is in
// use, from the global store's events, whatever the store: the count, the
// refusals for want of an ID, the health and log of the fill, and the
// forecast of the time to exhaustion.
type spaceWatch struct {
	lo, hi identity.NumericIdentity
	log    *slog.Logger
	health cell.Health // nil: not reported
	now    func() time.Time

	refusals atomic.Uint64

	mu sync.Mutex
	// used has a bit per ID of the range, set while the store has it.
	used  []uint64
	count int
	// refused: the store refused an allocation for want of an ID, and no
	// ID was taken or freed since.
	refused bool
	level   spaceLevel
	// percent is the whole percent last reported while not OK.
	percent int
	// samples is the count after each change, at most one per second,
	// oldest first, from the one before the forecast window on.
	samples []spaceSample
}

type spaceSample struct {
	at    time.Time
	count int
}

func newSpaceWatch(cluster identity.ClusterInfo, log *slog.Logger, h cell.Health) *spaceWatch {
	lo, hi := cluster.MinID(), cluster.MaxID()
	w := &spaceWatch{lo: lo, hi: hi, log: log, health: h, now: time.Now}
	w.used = make([]uint64, (uint64(hi)-uint64(lo))/64+1)
	if h != nil {
		h.OK(w.describe())
	}
	return w
}

func (w *spaceWatch) size() int { return int(w.hi-w.lo) + 1 }

// set records that the store has id (true) or no longer has it.
func (w *spaceWatch) set(id identity.NumericIdentity, has bool) {
	if w == nil || id < w.lo || id > w.hi {
		return
	}
	off := uint64(id - w.lo)
	word, bit := off/64, uint64(1)<<(off%64)
	w.mu.Lock()
	defer w.mu.Unlock()
	if (w.used[word]&bit != 0) == has {
		return
	}
	w.used[word] ^= bit
	if has {
		w.count++
	} else {
		w.count--
	}
	w.refused = false
	w.sampleLocked()
	w.updateLocked()
}

// refusedAllocation counts an allocation the store refused for want of an
// ID.
func (w *spaceWatch) refusedAllocation() {
	if w == nil {
		return
	}
	w.refusals.Add(1)
	w.mu.Lock()
	defer w.mu.Unlock()
	w.refused = true
	w.updateLocked()
}

// updateLocked reports a change of level, once, in the log and to health,
// and the fill in whole percent while not OK. Under mu.
func (w *spaceWatch) updateLocked() {
	level := spaceOK
	switch {
	case w.refused || w.count >= w.size():
		level = spaceExhausted
	case float64(w.count) >= globalstore.SpaceWarnRatio*float64(w.size()):
		level = spaceHigh
	}
	percent := w.count * 100 / w.size()
	changed := level != w.level
	if !changed && (level == spaceOK || percent == w.percent) {
		return
	}
	w.level, w.percent = level, percent
	msg := w.describe()
	switch {
	case changed && level == spaceOK:
		w.log.Info("Global identity space below the warning threshold again", "used", w.count, "size", w.size())
	case changed && level == spaceHigh:
		w.log.Warn("Global identity space nearly full: new label sets will be refused once it is", "used", w.count, "size", w.size(), "threshold", globalstore.SpaceWarnRatio)
	case changed:
		w.log.Warn("Global identity space exhausted: new label sets are refused until identities are released and collected", "used", w.count, "size", w.size())
	}
	if w.health == nil {
		return
	}
	if level == spaceOK {
		w.health.OK(msg)
		return
	}
	// Readiness is "can serve": a node serves its identities, lookups and
	// local identities with the range full, and every node of the cluster
	// unready at once would help no release (a restart frees no ID).
	w.health.OK(spaceDegradedPrefix + msg)
}

// spaceDegradedPrefix starts the identity-space scope's message from
// globalstore.SpaceWarnRatio on: the scope stays OK, and so readiness, while the
// message says the space is degraded.
const spaceDegradedPrefix = "Degraded, serving: "

// describe says how full the range is. Under mu, or before the watch is
// shared.
func (w *spaceWatch) describe() string {
	ratio := float64(w.count) / float64(w.size())
	switch {
	case w.refused || w.count >= w.size():
		return fmt.Sprintf("Global identity space exhausted: %d of %d IDs of this cluster's range in use (%.1f%%)", w.count, w.size(), 100*ratio)
	case ratio >= globalstore.SpaceWarnRatio:
		return fmt.Sprintf("Global identity space %.1f%% full (%d of %d IDs of this cluster's range; warning from %.0f%%)", 100*ratio, w.count, w.size(), 100*globalstore.SpaceWarnRatio)
	}
	return fmt.Sprintf("Global identity space %.1f%% full", 100*ratio)
}

// sampleLocked records the count for the forecast, and drops the samples
// the window no longer needs. Under mu.
func (w *spaceWatch) sampleLocked() {
	now := w.now()
	if n := len(w.samples); n > 0 && now.Sub(w.samples[n-1].at) < time.Second {
		w.samples[n-1].count = w.count
	} else {
		w.samples = append(w.samples, spaceSample{at: now, count: w.count})
	}
	// Keep one sample at or before the window's start: the count there.
	start := now.Add(-spaceForecastWindow)
	drop := 0
	for drop+1 < len(w.samples) && !w.samples[drop+1].at.After(start) {
		drop++
	}
	w.samples = w.samples[drop:]
}

// forecast returns the seconds until every ID of the range is in use at
// the net creation rate (identities the store gained minus those it lost)
// of the last spaceForecastWindow, or of the time since the first change
// where that is shorter: +Inf when the count does not grow, 0 when the
// range is full.
func (w *spaceWatch) forecast() float64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	free := w.size() - w.count
	if free <= 0 {
		return 0
	}
	if len(w.samples) == 0 {
		return math.Inf(1)
	}
	now := w.now()
	from := w.samples[0]
	span := now.Sub(from.at)
	if start := now.Add(-spaceForecastWindow); from.at.Before(start) {
		span = spaceForecastWindow
	}
	grown := w.count - from.count
	if grown <= 0 || span <= 0 {
		return math.Inf(1)
	}
	return float64(free) * span.Seconds() / float64(grown)
}
