// Package shell serves the hive's script commands on a unix socket in the
// state directory (<state-dir>/identityd.sock, mode 0600), so that every
// command a cell registers is usable on the running agent through
// `identityd shell`, and provides the client for it (Client, Split).
//
// A request is one line: a JSON array of strings, the command's name and
// its arguments, at most MaxRequestBytes long. The server runs that command
// with exactly those arguments, once: no line is ever handed to the script
// engine's parser, so nothing is split, expanded from an environment,
// taken as a comment or as a second command. The answer is a series of
// JSON lines, {"output": "..."} as the command writes and one
// {"end": "ok"} or {"end": "error", "error": "..."} at its end.
//
// Unlike the hive's own server it never removes a socket another agent is
// serving: the state directory's instance lock is held before the socket is
// touched, so a second agent fails at start instead.
//
// The cell needs a job registry (job.Cell) and a cell.Health provider: the
// start hook listens, and the job accept-connections (AcceptJob, health
// scope shell.job-accept-connections) accepts the connections and serves
// each in a goroutine on the job's context, which it waits for; it serves
// at most an eighth of the open-files limit at once (refusing the excess
// with ErrTooManyConnections) and retries a failed accept. A client
// that closes its connection while its command runs ends the command's
// context (watchHangup). The job
// stops right before the stop hook, which removes the socket: the commands
// running then end with their connections.
package shell

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"regexp"
	"runtime/debug"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/hive/script"
	"github.com/spf13/pflag"

	"github.com/identityd/identityd/cells/statedir"
)

// SocketName is the socket's file name in the state directory.
const SocketName = "identityd.sock"

// AcceptJob is the name of the job that accepts and serves the shell's
// connections; its health scope is "job-" + AcceptJob in the shell module.
const AcceptJob = "accept-connections"

// Cell serves the shell. It needs a job registry (job.Cell) and a
// cell.Health provider.
var Cell = cell.Module(
	"shell",
	"Operator shell on a unix socket",

	cell.Invoke(newServer),
)

type params struct {
	cell.In

	Log       *slog.Logger
	Lifecycle cell.Lifecycle
	Dir       *statedir.Dir
	Cmds      hive.ScriptCmds
	Jobs      job.Registry
	Health    cell.Health
}

type server struct {
	log *slog.Logger
	// engine holds the commands a request may name; help lists them.
	engine   *script.Engine
	path     string
	workDir  string
	listener net.Listener
}

func newServer(p params) {
	cmds := p.Cmds.Map()
	s := &server{
		log:     p.Log,
		path:    p.Dir.Join(SocketName),
		engine:  &script.Engine{Cmds: cmds},
		workDir: p.Dir.Path(),
	}
	cmds["help"] = s.helpCmd()
	p.Lifecycle.Append(s)
	// Queued after the hook: the job starts once the socket listens and
	// stops, ending the connections, before the hook removes the socket.
	p.Jobs.NewGroup(p.Health).Add(job.OneShot(AcceptJob, s.acceptLoop))
}

func (s *server) Start(cell.HookContext) error {
	// The state directory's lock is ours, so a socket left here belongs to
	// a previous run of this agent that did not stop cleanly.
	if err := os.Remove(s.path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("cannot remove stale shell socket %s: %w", s.path, err)
	}
	l, err := net.Listen("unix", s.path)
	if err != nil {
		return fmt.Errorf("cannot listen on shell socket %s: %w", s.path, err)
	}
	if err := os.Chmod(s.path, 0o600); err != nil {
		l.Close()
		return fmt.Errorf("cannot set mode 0600 on shell socket %s: %w", s.path, err)
	}
	s.listener = l
	s.log.Info("Shell listening", "socket", s.path)
	return nil
}

func (s *server) Stop(cell.HookContext) error {
	if s.listener == nil {
		return nil
	}
	// The accept job has closed it already, unless it never ran.
	s.listener.Close()
	os.Remove(s.path)
	return nil
}

// acceptLoop is the accept job: it serves each connection in a goroutine
// of its own, on the job's context, and returns once the context ended and
// every connection's goroutine did. Ending the context closes the listener
// and every connection, which ends the commands running on them.
//
// A failed accept (the process out of file descriptors, say) is retried
// after a pause that grows from 5ms to a second, as net/http's server does,
// so that the shell answers again as soon as descriptors are free. At most
// maxConns connections are served at once; a connection past that is
// answered with an error that says so and closed, so that a burst of
// clients cannot take the descriptors the datapath map, etcd, the
// checkpoint and the probes need.
func (s *server) acceptLoop(ctx context.Context, h cell.Health) error {
	stop := context.AfterFunc(ctx, func() { s.listener.Close() })
	defer stop()
	var conns sync.WaitGroup
	defer conns.Wait()
	limit := maxConns()
	slots := make(chan struct{}, limit)
	accepting := "Accepting connections on " + s.path
	h.OK(accepting)
	var (
		delay   time.Duration
		refused refusals
	)
	for {
		conn, err := s.listener.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if errors.Is(err, net.ErrClosed) {
				// The job fails, and so does health: the shell no
				// longer answers. Said now, not once the connections
				// still open have ended.
				err = fmt.Errorf("accepting shell connections on %s: %w", s.path, err)
				s.log.Error("Shell accept failed", "error", err)
				h.Degraded("Shell accept failed", err)
				return err
			}
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			if delay == 5*time.Millisecond {
				s.log.Warn("Shell accept failed; retrying", "error", err)
			}
			h.Degraded("Shell accept failed; retrying", fmt.Errorf("accepting shell connections on %s: %w", s.path, err))
			select {
			case <-time.After(delay):
			case <-ctx.Done():
				return nil
			}
			continue
		}
		if delay > 0 {
			delay = 0
			s.log.Info("Shell accepts connections again")
			h.OK(accepting)
		}
		select {
		case slots <- struct{}{}:
		default:
			refused.add(s.log, limit)
			refuse(conn, limit)
			continue
		}
		conns.Go(func() {
			defer func() { <-slots }()
			s.serve(ctx, conn)
		})
	}
}

// maxConns is the most shell connections served at once: an eighth of the
// process's open-files limit, between 4 and 128.
func maxConns() int {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return 32
	}
	return int(min(max(lim.Cur/8, 4), 128))
}

// refuse answers a connection past the limit with an error and closes it,
// without waiting on a client that does not read.
func refuse(conn net.Conn, limit int) {
	defer conn.Close()
	conn.SetWriteDeadline(time.Now().Add(time.Second))
	w := &frameWriter{enc: json.NewEncoder(conn), cancel: func() {}}
	w.end(fmt.Errorf("%w: %d are open, the most the agent serves at once; try again when one ends", ErrTooManyConnections, limit))
}

// ErrTooManyConnections: the agent already serves as many shell
// connections as it allows at once.
var ErrTooManyConnections = errors.New("too many shell connections")

// refusals logs refused connections: the first of a burst at once, then a
// count at most every 10 seconds.
type refusals struct {
	count   int
	last    time.Time
	pending int
}

func (r *refusals) add(log *slog.Logger, limit int) {
	r.count++
	r.pending++
	if now := time.Now(); now.Sub(r.last) >= 10*time.Second {
		log.Warn("Refusing shell connections: too many open", "limit", limit, "refused", r.pending, "refusedTotal", r.count)
		r.last, r.pending = now, 0
	}
}

func (s *server) serve(jobCtx context.Context, conn net.Conn) {
	ctx, cancel := context.WithCancel(jobCtx)
	defer cancel()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	defer conn.Close()

	// An empty environment: nothing the agent's environment holds can
	// reach a command, even one that expands variables itself.
	state, err := script.NewState(ctx, s.workDir, []string{})
	if err != nil {
		s.log.Error("Shell state", "error", err)
		return
	}
	w := &frameWriter{enc: json.NewEncoder(conn), cancel: cancel}
	w.enc.SetEscapeHTML(false)
	r := bufio.NewReader(conn)
	for {
		line, err := readRequest(r)
		if errors.Is(err, ErrRequestTooLarge) {
			w.end(err)
			continue
		}
		if err != nil {
			return
		}
		args, err := decodeRequest(line)
		if err == nil {
			unwatch := watchHangup(conn, cancel)
			err = s.execute(state, args, w)
			unwatch()
		}
		w.end(err)
		if ctx.Err() != nil {
			return
		}
	}
}

// execute runs one command; a panicking command becomes its error instead
// of taking the agent down.
func (s *server) execute(state *script.State, args []string, w io.Writer) (err error) {
	defer func() {
		if r := recover(); r != nil {
			s.log.Error("Panic in shell command", "command", args[0], "panic", r, "stack", string(debug.Stack()))
			err = fmt.Errorf("%s: internal error: %v", args[0], r)
		}
	}()
	name := args[0]
	cmd, ok := s.engine.Cmds[name]
	if !ok {
		return fmt.Errorf("unknown command %q; 'help' lists the commands", name)
	}
	// The engine is what flushes a command's log to the connection, also
	// while the command runs (db/watch does). It gets a fixed line naming
	// one command that runs the requested one with the argument vector
	// as received, so the engine's parser never sees what a client sent.
	const dispatch = "run"
	run := script.Command(script.CmdUsage{Summary: "run the requested command"},
		func(st *script.State, _ ...string) (script.WaitFunc, error) {
			return nil, s.invoke(st, name, cmd, args[1:])
		})
	err = (&script.Engine{Cmds: map[string]script.Cmd{dispatch: run}}).ExecuteLine(state, dispatch, w)
	if cmdErr := (*script.CommandError)(nil); errors.As(err, &cmdErr) && cmdErr.Op == dispatch {
		err = cmdErr.Err
	}
	if err == nil {
		return nil
	}
	if errors.Is(err, script.ErrUsage) {
		return fmt.Errorf("%s: %w; usage: %s %s", name, err, name, cmd.Usage().Args)
	}
	return fmt.Errorf("%s: %w", name, err)
}

// invoke runs cmd with args the way the script engine would after its
// parsing: a command that declares flags has them parsed (pflag: "-o json",
// "--owner=x", "--" ends the flags, -h shows its help); a command without
// flags gets its arguments as they are. Output goes to the state's log,
// which the engine writes to the connection.
func (s *server) invoke(st *script.State, name string, cmd script.Cmd, args []string) error {
	usage := cmd.Usage()
	fs := pflag.NewFlagSet(name, pflag.ContinueOnError)
	fs.Usage = func() {}
	fs.SetOutput(io.Discard)
	if usage.Flags != nil {
		usage.Flags(fs)
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, pflag.ErrHelp) {
				return s.engine.ListCmds(st.LogWriter(), true, "^"+regexp.QuoteMeta(name)+"$")
			}
			return err
		}
		args = fs.Args()
	} else if err := fs.Parse(nil); err != nil {
		return err
	}
	// A command without flags that reads st.Flags finds an empty set, not
	// the previous command's.
	st.Flags = fs
	wait, err := cmd.Run(st, args...)
	if err != nil || wait == nil {
		return err
	}
	stdout, stderr, err := wait(st)
	io.WriteString(st.LogWriter(), stdout)
	io.WriteString(st.LogWriter(), stderr)
	return err
}

func (s *server) helpCmd() script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "list the commands; with a regexp, the matching ones in full",
			Args:    "[-v] [regexp]",
		},
		func(st *script.State, args ...string) (script.WaitFunc, error) {
			verbose := false
			if len(args) > 0 && args[0] == "-v" {
				verbose, args = true, args[1:]
			}
			if len(args) > 1 {
				return nil, script.ErrUsage
			}
			re := ""
			if len(args) == 1 {
				verbose, re = true, args[0]
			}
			var b strings.Builder
			if err := s.engine.ListCmds(&b, verbose, re); err != nil {
				return nil, err
			}
			out := b.String()
			return func(*script.State) (string, string, error) { return out, "", nil }, nil
		})
}

// oneLine keeps an error on a single line, as terminals and logs show the
// error of a command as one line.
func oneLine(err error) string {
	b := []byte(err.Error())
	for i, c := range b {
		if c == '\n' || c == '\r' {
			b[i] = ' '
		}
	}
	return string(b)
}

// frameWriter sends what a command writes as output frames and ends each
// answer with its end frame. A failed write cancels the connection's
// context, so a command whose client is gone stops.
type frameWriter struct {
	enc    *json.Encoder
	cancel context.CancelFunc
	failed bool
}

func (w *frameWriter) Write(b []byte) (int, error) {
	if len(b) == 0 {
		return 0, nil
	}
	if err := w.send(frame{Output: string(b)}); err != nil {
		return 0, err
	}
	return len(b), nil
}

func (w *frameWriter) end(err error) {
	if err == nil {
		w.send(frame{End: endOK})
		return
	}
	w.send(frame{End: endError, Error: oneLine(err)})
}

func (w *frameWriter) send(f frame) error {
	if w.failed {
		return net.ErrClosed
	}
	if err := w.enc.Encode(f); err != nil {
		w.failed = true
		w.cancel()
		return err
	}
	return nil
}
