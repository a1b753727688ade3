package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"

	"github.com/identityd/identityd/cells/allocator"
	healthpkg "github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/durability"
	"github.com/identityd/identityd/internal/journal"
)

// Checkpoint keeps the checkpoint file in step with the allocator's local
// identities. It observes the allocator and asks for a write on every
// local allocation and every release to zero, coalescing the writes to at
// most one per interval; it writes once more on stop, as the allocator's
// finalizer. Every method is safe for concurrent use.
type Checkpoint struct {
	log      *slog.Logger
	path     string
	interval time.Duration
	jobs     job.Group

	alloc allocator.Allocator

	// dirty says a change was observed since the last write began; wake
	// (capacity 1) tells the trigger loop about it.
	dirty atomic.Bool
	wake  chan struct{}
	// changed says the allocator changed a local identity during this
	// run, or this run wrote the file.
	changed atomic.Bool
	// startedAt delays the first triggered write, see run; only run
	// uses it.
	startedAt time.Time

	// wsem (capacity 1) serializes writes; a channel rather than a mutex,
	// so that Sync stops waiting for a write when its context ends.
	wsem chan struct{}
	// begun counts the writes that have begun: a write takes its snapshot
	// after counting itself, so a write numbered above the count Sync read
	// holds everything allocated before Sync was called.
	begun atomic.Uint64
	// durable is the number of the last successful write; guarded by wsem.
	durable uint64

	// mu guards the fields below; writes hold it too.
	mu sync.Mutex
	// buf is reused by every write: the encoding of a large state is
	// megabytes, and a fresh buffer each interval only feeds the GC.
	buf    []byte
	status Status
	// atStop holds the local identities live when the hive's stop began
	// (see stopSnapshot); nil until then.
	atStop []*identity.Identity
	// blocked holds the error that forbids writing: a bad file that
	// could not be kept aside must not be overwritten.
	blocked error
	// fault injects failures into the steps of a write, for tests.
	fault func(step string) error

	loads, corrupt, invalidEntries, writes, writeFailures atomic.Uint64

	// jmu guards the journal's state below; it is taken after mu and
	// after the journal's own write lock, never before them.
	jmu sync.Mutex
	// jrn is the journal of local identity changes, nil until Load or
	// the first durable answer opened it.
	jrn *journal.Journal
	// loaded says Load has run: the journal is opened there, with the
	// checkpoint it is replayed over.
	loaded bool
	// journaled is the state replaying the journal over the checkpoint
	// file gives: what a restart would restore.
	journaled map[identity.NumericIdentity]jentry
	// early holds the changes observed before the journal was open.
	early []allocator.Change
	// jwake is closed and replaced whenever journaled or stopped changes
	// (notifyLocked); a waiter takes it under jmu with what it read.
	jwake chan struct{}
	// stopped says the allocator's changes are no longer observed.
	stopped bool
	// capturing and since: the changes recorded while a write takes its
	// snapshot and writes it.
	capturing bool
	since     []jrec
	jbuf      []byte
	// jopen serializes opening the journal without Load.
	jopen sync.Mutex
	// jfault injects failures into the journal's writes, for tests.
	jfault atomic.Pointer[func(step string) error]
}

type params struct {
	cell.In

	Log       *slog.Logger
	Config    Config
	Dir       *statedir.Dir
	Jobs      job.Registry
	Health    cell.Health
	Allocator allocator.Allocator
	Lifecycle cell.Lifecycle
}

func newCheckpoint(p params) (*Checkpoint, error) {
	if err := p.Config.Validate(); err != nil {
		return nil, err
	}
	c := &Checkpoint{
		log:      p.Log,
		path:     p.Dir.Join(FileName),
		interval: p.Config.IdentityCheckpointInterval,
		jobs:     p.Jobs.NewGroup(p.Health),
		alloc:    p.Allocator,
		wake:     make(chan struct{}, 1),
		wsem:     make(chan struct{}, 1),
		jwake:    make(chan struct{}),
	}
	p.Lifecycle.Append(stopSnapshot{c})
	// The checkpoint depends on the allocator, so the trigger loop stops
	// before the allocator's stop hook runs the final write, which thus
	// never races with it.
	c.jobs.Add(job.OneShot("checkpoint-trigger", c.run))
	return c, nil
}

// Path returns the checkpoint file's path.
func (c *Checkpoint) Path() string { return c.path }

// finalWrite writes the final checkpoint. It is the allocator's finalizer
// (allocator.NewFinalizer), which the allocator's stop hook runs after the
// stop hooks of every cell that uses the allocator, so that their last
// allocations and releases are in the file whatever the order of the
// cells. A run that saw no local change, did not write and holds no local
// identity leaves the file alone: an agent that fails to start before
// restoration loaded the file must not replace it with an empty state.
// (Local identities exist only if this run allocated them, which counts as
// a change even when the allocator's event for it is still on its way.)
//
// The journal is emptied by the final write and closed after it; if the
// write fails, the journal keeps every change instead.
func (c *Checkpoint) finalWrite(context.Context) error {
	if !c.changed.Load() && !c.dirty.Load() && c.alloc != nil && len(c.alloc.LocalIdentities()) == 0 {
		c.log.Debug("No local identity changed, checkpoint left as is", "file", c.path)
		c.closeJournal(nil)
		return nil
	}
	_, err := c.Write()
	c.closeJournal(err)
	if err != nil {
		return fmt.Errorf("final checkpoint: %w", err)
	}
	return nil
}

// stopSnapshot is the checkpoint's pre-stop hook, which hive runs before
// every normal stop hook whatever the order of the cells: it takes the
// local identities that are live when the stop begins.
type stopSnapshot struct{ c *Checkpoint }

func (stopSnapshot) Start(cell.HookContext) error { return nil }

func (s stopSnapshot) Stop(cell.HookContext) error {
	s.c.mu.Lock()
	defer s.c.mu.Unlock()
	if s.c.alloc != nil {
		s.c.atStop = s.c.alloc.LocalIdentities()
	}
	return nil
}

// PreStopHookMarker makes hive run Stop before the normal stop hooks.
func (stopSnapshot) PreStopHookMarker() {}

// keepReleasedAtStop adds to ids the identities of atStop (live when the
// stop began) that were released since, unless their number or label set
// is taken by another identity now. A cell that releases its identities
// in its stop hook would otherwise empty the final checkpoint, and every
// local identity would get a new number at the next start; kept, they are
// restored and, when nobody takes them up again, released after the grace
// period.
func keepReleasedAtStop(ids, atStop []*identity.Identity) []*identity.Identity {
	byID := make(map[identity.NumericIdentity]struct{}, len(ids))
	byLabels := make(map[string]struct{}, len(ids))
	for _, id := range ids {
		if id != nil {
			byID[id.ID] = struct{}{}
			byLabels[id.Labels.Canonical()] = struct{}{}
		}
	}
	for _, id := range atStop {
		if id == nil {
			continue
		}
		if _, taken := byID[id.ID]; taken {
			continue
		}
		if _, taken := byLabels[id.Labels.Canonical()]; taken {
			continue
		}
		ids = append(ids, id)
	}
	return ids
}

// request marks the state dirty and wakes the trigger loop.
func (c *Checkpoint) request() {
	c.changed.Store(true)
	c.dirty.Store(true)
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// run observes the allocator and writes when asked, at most once per
// interval. The initial replay of the allocator's state counts as one
// change if it holds local identities (they can only have been allocated
// by this run). No local identity changes before restoration has loaded
// the old file (other local allocations wait for it), so no triggered
// write replaces a file that was not read; the first one waits one
// interval after start.
func (c *Checkpoint) run(ctx context.Context, health cell.Health) error {
	c.startedAt = time.Now()
	var synced, replayedLocal atomic.Bool
	observed := make(chan error, 1)
	c.alloc.Observe(ctx,
		func(ch allocator.Change) {
			switch {
			case ch.Kind == allocator.ChangeSync:
				synced.Store(true)
				// Local identities in the replay were allocated
				// after start but before this subscription: one
				// request covers them all.
				if replayedLocal.Load() {
					c.request()
				}
			case !ch.ID.HasLocalScope():
			case synced.Load():
				c.record(ch)
				c.request()
			default:
				c.record(ch)
				replayedLocal.Store(true)
			}
		},
		func(err error) {
			c.observerStopped()
			observed <- err
		})

	health.OK("Waiting for local identity changes")
	var (
		timer  *time.Timer
		timerC <-chan time.Time
		// retry is the pause before the next attempt after a failed
		// write (a full disk, say), so that the checkpoint is written
		// again as soon as it can be, without waiting for a change.
		retry time.Duration
	)
	write := func() {
		if c.triggeredWrite(health) {
			retry = 0
			return
		}
		retry = min(max(2*retry, time.Second), maxRetry)
		if timerC == nil {
			timer = time.NewTimer(retry)
			timerC = timer.C
		}
	}
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		select {
		case <-ctx.Done():
			<-observed
			return nil
		case err := <-observed:
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("allocator changes ended: %w", errOrEOF(err))
		case <-c.wake:
			c.flushIfPiledUp()
			if timerC != nil {
				continue
			}
			if wait := time.Until(c.nextWrite()); wait > 0 && !c.journalOversized() {
				timer = time.NewTimer(wait)
				timerC = timer.C
				continue
			}
			write()
		case <-timerC:
			timer, timerC = nil, nil
			write()
		}
	}
}

// maxRetry bounds the pause between attempts of a failed triggered write:
// a disk that had no room for minutes gets its checkpoint, and the agent
// its readiness, within seconds of having room again. An attempt on a
// full disk fails at its first write, so a short pause costs little.
const maxRetry = 2 * time.Second

func errOrEOF(err error) error {
	if err == nil {
		return errors.New("stream completed")
	}
	return err
}

// nextWrite is the earliest time of the next triggered write.
func (c *Checkpoint) nextWrite() time.Time {
	c.mu.Lock()
	last := c.status.LastWrite
	c.mu.Unlock()
	if c.startedAt.After(last) {
		last = c.startedAt
	}
	return last.Add(c.interval)
}

// triggeredWrite writes the checkpoint if a change is pending, and reports
// whether nothing is left to write.
func (c *Checkpoint) triggeredWrite(health cell.Health) bool {
	if !c.dirty.Load() {
		// A write since the request (a command) already took it.
		return true
	}
	st, err := c.Write()
	if err != nil {
		c.log.Error("Checkpoint write failed", "file", c.path, "error", err)
		// A full or read-only file system is not the agent's fault and
		// a restart would not mend it: not ready, still live.
		health.Degraded("Checkpoint write failed", healthpkg.ExternalIO(err))
		return false
	}
	health.OK(fmt.Sprintf("Wrote %d identities", st.Entries))
	return true
}

// Write writes a snapshot of the allocator's local identities now.
func (c *Checkpoint) Write() (Status, error) {
	c.wsem <- struct{}{}
	defer func() { <-c.wsem }()
	return c.write()
}

// Sync returns once a checkpoint that holds every local identity allocated
// before the call is on disk: the durability point of local identities
// (allocator.LocalIdentitySyncer). It writes at once, ignoring
// --identity-checkpoint-interval, unless a write that began after the call
// has already succeeded; callers that wait while a write is running share
// the next one, so a burst of N concurrent calls costs about two writes,
// not N. It fails with the write's error, or with ctx's error when ctx ends
// first, even during a write (the identities are then in that write, if it
// succeeds, or wait for a later one).
//
// Sync writes nothing before restoration has finished, and so loaded the
// file (Allocator.WaitForRestoration; at once in a hive without
// restoration): a start hook that calls it may wait for its own end.
func (c *Checkpoint) Sync(ctx context.Context) error {
	// Read before anything else: a write numbered above need began after
	// the call, so its snapshot holds what was allocated before.
	need := c.begun.Load() + 1
	if err := c.alloc.WaitForRestoration(ctx); err != nil {
		return fmt.Errorf("checkpoint sync: %w", err)
	}
	select {
	case c.wsem <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("checkpoint sync: waiting for the running write: %w", ctx.Err())
	}
	// A write cannot be interrupted (an fsync on a stalled disk may take
	// minutes), but its caller's wait can: the write goes on, holding
	// wsem, and the identities are in the file once it ends.
	err := durability.Wait(ctx, func() error {
		defer func() { <-c.wsem }()
		if c.durable >= need {
			// Written while this call waited for the running write.
			return nil
		}
		_, err := c.write()
		return err
	})
	if errors.Is(err, durability.ErrWriteNotEnded) {
		return fmt.Errorf("checkpoint sync: %w", err)
	}
	return err
}

// write is Write with wsem held. With the journal open, the write is its
// snapshot: once the file is on disk, the journal is emptied of the
// records it holds.
func (c *Checkpoint) write() (Status, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.blocked != nil {
		return c.status, c.blocked
	}
	if c.alloc == nil {
		return c.status, errors.New("checkpoint is not attached to an allocator")
	}
	j, err := c.journalIfRestored()
	if err != nil {
		c.log.Warn("Identity journal unavailable", "file", c.journalPath(), "error", err)
	}
	if j == nil {
		st, _, err := c.writeSnapshot(nil, nil)
		return st, err
	}
	var (
		st  Status
		ids []*identity.Identity
	)
	cerr := j.Compact(func(flush func(uint64, journal.Base)) (uint64, journal.Base, error) {
		var (
			upTo uint64
			err  error
		)
		st, ids, err = c.writeSnapshot(func() { upTo = c.beginCapture(j) }, func() { flush(upTo, journal.BaseOf(c.buf)) })
		c.endCapture(ids, err == nil)
		// The journal's header names the file just written: its records
		// are replayed over it, and over no other.
		return upTo, journal.BaseOf(c.buf), err
	})
	if cerr != nil && st.LastError == nil {
		// The checkpoint is on disk, but the journal could not be
		// emptied: it still names the old checkpoint, and a restart
		// keeps it aside, which loses nothing (the new checkpoint holds
		// its records). Until a write empties it, durable answers write
		// the whole checkpoint instead (journal.ErrBroken).
		c.log.Warn("Identity journal not emptied after the checkpoint write", "file", j.Path(), "error", cerr)
		return st, nil
	}
	return st, cerr
}

// writeSnapshot takes the allocator's local identities and writes them;
// capture, when not nil, runs right before they are taken, and flush
// right before the file is written. mu held.
func (c *Checkpoint) writeSnapshot(capture, flush func()) (Status, []*identity.Identity, error) {
	// Cleared before the snapshot, so that a change racing with it asks
	// for another write.
	c.dirty.Store(false)
	gen := c.begun.Add(1)
	t0 := time.Now()
	if capture != nil {
		capture()
	}
	ids := c.alloc.LocalIdentities()
	if c.atStop != nil {
		ids = keepReleasedAtStop(ids, c.atStop)
	}
	c.buf = AppendJSON(c.buf[:0], ids)
	if flush != nil {
		flush()
	}
	err := writeFile(c.path, c.buf, c.fault)
	d := time.Since(t0)
	if err != nil {
		c.writeFailures.Add(1)
		c.dirty.Store(true)
		c.status.LastError = fmt.Errorf("write checkpoint %s: %w", c.path, err)
		c.status.LastErrorTime = t0
		return c.status, ids, c.status.LastError
	}
	c.changed.Store(true)
	c.durable = gen
	c.writes.Add(1)
	n := 0
	for _, id := range ids {
		if id != nil && id.ID.HasLocalScope() {
			n++
		}
	}
	c.status.LastWrite = t0
	c.status.Duration = d
	c.status.Size = int64(len(c.buf))
	c.status.Entries = n
	c.status.LastError = nil
	c.log.Debug("Checkpoint written", "file", c.path, "identities", n, "bytes", len(c.buf), "duration", d)
	return c.status, ids, nil
}

// Load reads the checkpoint for restoration; see Loader.Load. It must run
// before the allocator hands out new local IDs and before the first write:
// both wait for the restoration registered with the allocator, which calls
// it. When a bad file
// could not be kept aside, writing is disabled so that it is never lost.
//
// The journal of local identity changes beside the checkpoint
// (JournalFileName) is replayed over the file's identities: the result is
// what the agent held at its last durable answer. A damaged journal (a
// torn, corrupt, cut or overwritten record, a damaged header) is replayed
// up to its last valid record and then with the records after the damage
// that still verify; a copy of it is kept as <journal>.corrupt-<unix
// time>. A journal that follows another checkpoint than the file read is
// replayed over it too, and reported the same way, unless the file holds
// its records already (a crash between a checkpoint write and the
// journal's reset, no damage). An empty journal is damage: its changes
// are unknown. Report.Journal says what was found; LoadResult.Seen every
// number the state files and their kept copies name. A journal that
// cannot be opened fails Load with ErrJournalUnusable.
func (c *Checkpoint) Load() (res LoadResult, err error) {
	defer func() {
		seen, files := seenInCopies(filepath.Dir(c.path))
		res.Seen = append(res.Seen, seen...)
		res.Report.CopiesRead = files
	}()
	res, base, err := Loader{Log: c.log}.loadBase(c.path)
	c.loads.Add(1)
	if res.Report.Corrupt != nil {
		c.corrupt.Add(1)
	}
	c.invalidEntries.Add(uint64(len(res.Report.Invalid)))
	if err != nil {
		c.mu.Lock()
		c.blocked = fmt.Errorf("writing disabled: %w", err)
		c.mu.Unlock()
		return res, err
	}
	c.jmu.Lock()
	c.loaded = true
	c.jmu.Unlock()
	if jerr := c.loadJournal(&res, base); jerr != nil {
		// The journal could not be read or kept aside: it must not be
		// overwritten, and the checkpoint file must not be replaced by a
		// state that lacks its records.
		c.mu.Lock()
		c.blocked = fmt.Errorf("writing disabled: %w", jerr)
		c.mu.Unlock()
		c.log.Error("Identity journal cannot be read, checkpoint writes disabled", "file", c.journalPath(), "error", jerr)
		return res, jerr
	}
	return res, nil
}

// Status is the state of the checkpoint, for health and metrics.
type Status struct {
	// LastWrite is the start of the last successful write (zero if none).
	LastWrite time.Time
	// Duration is how long that write took: snapshot, encoding and the
	// atomic write with its fsyncs.
	Duration time.Duration
	// Size is the file's size in bytes after that write.
	Size int64
	// Entries is the number of identities it holds.
	Entries int
	// LastError is the error of the last write if it failed, else nil.
	LastError error
	// LastErrorTime is when that write began.
	LastErrorTime time.Time
	// Pending says a change waits for the next write.
	Pending bool
	// Counters count events since the agent started.
	Counters Counters
}

// Counters count the checkpoint's events, for metrics.
type Counters struct {
	Writes         uint64
	WriteFailures  uint64
	Loads          uint64
	CorruptFiles   uint64
	InvalidEntries uint64
}

// Status returns the checkpoint's status.
func (c *Checkpoint) Status() Status {
	c.mu.Lock()
	st := c.status
	c.mu.Unlock()
	st.Pending = c.dirty.Load()
	st.Counters = Counters{
		Writes:         c.writes.Load(),
		WriteFailures:  c.writeFailures.Load(),
		Loads:          c.loads.Load(),
		CorruptFiles:   c.corrupt.Load(),
		InvalidEntries: c.invalidEntries.Load(),
	}
	return st
}
