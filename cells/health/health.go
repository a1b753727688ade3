// Package health is the agent's cell.Health provider. Unlike hive's
// SimpleHealth it can list every scope's last report, which the /healthz
// endpoint (cells/metrics) and the `health` shell command need.
//
// Scopes form a tree: the root cell.Health, one scope per module when the
// hive is built with ModuleDecorators, and below them the scopes hive's job
// groups create for each job ("job-<name>", "timer-job-<name>", ...). A scope
// that has never reported takes the state of the scopes below it; one with
// nothing below it that has never reported is Unknown, so a module counts as
// healthy only once it (or every job it runs) said OK.
//
// A closed scope stays in the tree: hive closes a one-shot job's scope when
// the job returns, and a module whose jobs have all finished their work must
// not fall back to Unknown (a liveness probe would restart the agent for
// doing its work). It stays Stopped, with its last message, unless it closed
// while Degraded (a job that failed for good), which it then stays. A new
// scope of the same name replaces it.
//
// Two questions are asked of the tree. Healthy (readiness): is every scope
// OK or Stopped? Live (liveness): is every scope OK or Stopped, or Degraded
// only for a cause outside the process, marked with External (etcd
// unreachable: restarting the agent would not bring it back, and its local
// work still runs)?
//
// Use it in place of cell.SimpleHealthCell:
//
//	opts := hive.DefaultOptions()
//	opts.ModuleDecorators = health.ModuleDecorators
//	h := hive.NewWithOptions(opts, health.Cell, job.Cell, ...)
package health

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/cilium/hive/cell"
)

// Cell provides cell.Health, *Provider and the `health` script command.
var Cell = cell.Module(
	"health",
	"Module health reporting",

	cell.Provide(
		newProvider,
		func(p *Provider) cell.Health { return p.Root() },
		newCommands,
	),
)

// ModuleDecorators gives every module of the hive its own health scope,
// named by its module ID, so that reports say which module they come from.
// Set it as hive.Options.ModuleDecorators.
var ModuleDecorators = cell.ModuleDecorators{decorateModule}

// decorateModule takes the Provider rather than the cell.Health in scope so
// that nested modules get their full path whatever the parent passed down.
func decorateModule(_ cell.Health, p *Provider, id cell.FullModuleID) cell.Health {
	return p.scopeAt(id)
}

// Status is the state of one health scope.
type Status struct {
	// Name is the scope's dotted path, e.g. "ipcache.job-ipcache-map-sync";
	// the root scope is "(root)".
	Name string
	// Level is the effective level: the scope's own report combined with
	// the scopes below it (the worst wins; see the package doc).
	Level cell.Level
	// Message is the scope's own last message (empty if it never
	// reported).
	Message string
	// Error is the error of the last Degraded report, "" otherwise.
	Error string
	// External is true when the last Degraded report's error is marked
	// with External: the cause lies outside the process.
	External bool
	// Updated is when the scope last reported (zero if never).
	Updated time.Time
}

// OK reports whether the level counts as healthy: OK or Stopped (a job that
// finished its work is not a fault).
func (s Status) OK() bool { return s.Level == cell.StatusOK || s.Level == cell.StatusStopped }

// ErrExternal marks the error of a Degraded report whose cause lies outside
// the process, such as an unreachable etcd. Such a report makes the agent
// not ready, but not dead: see Provider.Live.
var ErrExternal = errors.New("cause outside the agent")

// External marks err (which may be nil) as caused outside the process, for
// cell.Health's Degraded. Its message is err's.
func External(err error) error { return externalError{err} }

// ExternalIO marks err as External when it is a file system's refusal
// that a restart of the agent would not mend: no space or quota left
// (ENOSPC, EDQUOT, EFBIG), a read-only or immutable file or directory
// (EROFS, EPERM, EACCES), or an I/O error of the device (EIO). Other
// errors are returned as they are.
func ExternalIO(err error) error {
	for _, errno := range []syscall.Errno{syscall.ENOSPC, syscall.EDQUOT, syscall.EFBIG, syscall.EROFS, syscall.EPERM, syscall.EACCES, syscall.EIO} {
		if errors.Is(err, errno) {
			return External(err)
		}
	}
	return err
}

type externalError struct{ err error }

func (e externalError) Error() string {
	if e.err == nil {
		return ErrExternal.Error()
	}
	return e.err.Error()
}

func (e externalError) Unwrap() []error { return []error{ErrExternal, e.err} }

// Provider keeps the health tree of a hive. One per hive: there is no
// process-wide state.
type Provider struct {
	mu   sync.Mutex
	root *scope
	now  func() time.Time
}

func newProvider() *Provider {
	p := &Provider{now: time.Now}
	p.root = &scope{p: p}
	return p
}

// NewProvider returns an empty health tree, for hives and tests that do not
// use Cell.
func NewProvider() *Provider { return newProvider() }

// Root returns the root scope.
func (p *Provider) Root() cell.Health { return p.root }

// scopeAt returns the scope of a module path, creating the missing ones.
// Module scopes are shared: a module asking twice gets the same scope.
func (p *Provider) scopeAt(path cell.FullModuleID) *scope {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.root
	for _, name := range path {
		c, ok := s.children[name]
		if !ok {
			c = &scope{p: p, parent: s, name: name}
			s.addChild(c)
		}
		s = c
	}
	return s
}

// All returns the status of every scope, parents before their children,
// sorted by name. The root appears only when something reported to it
// directly.
func (p *Provider) All() []Status {
	all, _ := p.walk()
	return all
}

// Healthy reports whether every scope is OK (or Stopped), and returns the
// statuses of the scopes that cause it not to be: the ones an operator must
// look at (not their parents). An empty tree is healthy. It answers
// readiness: whether the agent can do all its work now.
func (p *Provider) Healthy() (bool, []Status) {
	_, bad := p.walk()
	return len(bad) == 0, bad
}

// Live is Healthy without the scopes that are Degraded for a cause marked
// External: it answers liveness, whether the process's own work runs (a
// restart could help), and returns the scopes that say it does not. Unknown
// scopes count against it, as during start.
func (p *Provider) Live() (bool, []Status) {
	_, bad := p.walk()
	own := bad[:0]
	for _, st := range bad {
		if !st.External {
			own = append(own, st)
		}
	}
	return len(own) == 0, own
}

// walk lists every scope, and apart the ones whose own state is bad.
func (p *Provider) walk() (all, bad []Status) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var visit func(s *scope, name string)
	visit = func(s *scope, name string) {
		if s.parent != nil || s.reported {
			st := Status{
				Name:     name,
				Level:    s.effective(),
				Message:  s.message,
				Error:    s.err,
				External: s.external,
				Updated:  s.updated,
			}
			if st.Name == "" {
				st.Name = "(root)"
			}
			all = append(all, st)
			if s.ownBad() {
				bad = append(bad, st)
			}
		}
		kids := make([]*scope, 0, len(s.children))
		for _, c := range s.children {
			kids = append(kids, c)
		}
		slices.SortFunc(kids, func(a, b *scope) int { return cmp.Compare(a.name, b.name) })
		for _, c := range kids {
			if name == "" {
				visit(c, c.name)
			} else {
				visit(c, name+"."+c.name)
			}
		}
	}
	visit(p.root, "")
	return all, bad
}

// scope is one node of the tree. All fields are guarded by p.mu.
type scope struct {
	p        *Provider
	parent   *scope
	name     string
	children map[string]*scope

	reported bool
	level    cell.Level
	message  string
	err      string
	external bool
	updated  time.Time
	closed   bool
}

var _ cell.Health = (*scope)(nil)

func (s *scope) addChild(c *scope) {
	if s.children == nil {
		s.children = map[string]*scope{}
	}
	s.children[c.name] = c
}

// effective combines the scope's own level with its children's: Degraded
// beats Unknown beats OK and Stopped. Without an own report and without
// children the scope is Unknown: it has not said it is ready.
func (s *scope) effective() cell.Level {
	lvl := cell.StatusUnknown
	if s.reported {
		lvl = s.level
	} else if len(s.children) > 0 {
		lvl = cell.StatusOK
	}
	for _, c := range s.children {
		lvl = worse(lvl, c.effective())
	}
	return lvl
}

// ownBad reports whether the scope itself, not one below it, is the reason
// for a bad effective level.
func (s *scope) ownBad() bool {
	if s.reported {
		return rank(s.level) > rank(cell.StatusOK)
	}
	return len(s.children) == 0 && s.parent != nil
}

func rank(l cell.Level) int {
	switch l {
	case cell.StatusDegraded:
		return 3
	case cell.StatusUnknown:
		return 2
	case cell.StatusOK:
		return 1
	}
	return 0 // Stopped
}

func worse(a, b cell.Level) cell.Level {
	if rank(b) > rank(a) {
		return b
	}
	return a
}

func (s *scope) report(level cell.Level, msg string, err error) {
	s.p.mu.Lock()
	defer s.p.mu.Unlock()
	// A closed scope is gone from the tree; a late report from a job
	// that is winding down must not resurrect it.
	if s.closed {
		return
	}
	s.reported = true
	s.level = level
	s.message = msg
	s.err = ""
	s.external = false
	if err != nil {
		s.err = err.Error()
		s.external = level == cell.StatusDegraded && errors.Is(err, ErrExternal)
	}
	s.updated = s.p.now()
}

// OK implements cell.Health.
func (s *scope) OK(status string) { s.report(cell.StatusOK, status, nil) }

// Stopped implements cell.Health.
func (s *scope) Stopped(reason string) { s.report(cell.StatusStopped, reason, nil) }

// Degraded implements cell.Health.
func (s *scope) Degraded(reason string, err error) { s.report(cell.StatusDegraded, reason, err) }

// NewScope implements cell.Health. A scope of the same name replaces the
// previous one, as a restarted job's does.
func (s *scope) NewScope(name string) cell.Health {
	s.p.mu.Lock()
	defer s.p.mu.Unlock()
	c := &scope{p: s.p, parent: s, name: name}
	s.addChild(c)
	return c
}

// Close implements cell.Health. The scope stays in the tree with its last
// report, as Stopped (its work is done) unless it was Degraded; the scopes
// below it vanish and later reports to it are ignored. Without this a module
// whose one-shot jobs have all returned would have nothing below it and no
// report of its own, and count as Unknown for the rest of its life.
func (s *scope) Close() {
	s.p.mu.Lock()
	defer s.p.mu.Unlock()
	if s.closed {
		return
	}
	s.closed = true
	s.children = nil
	if !s.reported || s.level != cell.StatusDegraded {
		s.reported = true
		s.level = cell.StatusStopped
		s.updated = s.p.now()
	}
}

// Format writes one line per scope: name, level, message and error.
func Format(statuses []Status) string {
	var b strings.Builder
	for _, st := range statuses {
		fmt.Fprintf(&b, "%s: level=%s message=%q", st.Name, st.Level, st.Message)
		if st.Error != "" {
			fmt.Fprintf(&b, " error=%q", st.Error)
		}
		if st.External {
			b.WriteString(" cause=external")
		}
		b.WriteByte('\n')
	}
	return b.String()
}

// OrDetached returns h, or without one (a hive without a health provider)
// a scope of a provider of its own, which nothing reads: the jobs of a
// cell need a scope to report to either way.
func OrDetached(h cell.Health) cell.Health {
	if h != nil {
		return h
	}
	return newProvider().Root()
}
