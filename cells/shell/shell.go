// Package shell serves the hive's script commands on a unix socket in the
// state directory (<state-dir>/identityd.sock, mode 0600), so that every
// command a cell registers is usable on the running agent through
// `identityd shell`. It speaks the protocol of github.com/cilium/hive/shell,
// whose client it works with.
//
// Unlike the hive's own server it never removes a socket another agent is
// serving: the state directory's instance lock is held before the socket is
// touched, so a second agent fails at start instead.
package shell

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"runtime/debug"
	"sync"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/script"

	"github.com/identityd/identityd/cells/statedir"
)

// SocketName is the socket's file name in the state directory.
const SocketName = "identityd.sock"

// Markers of the hive shell protocol.
const (
	endMarker   = "<<end>>"
	errorMarker = "<<error>>"
)

// Cell serves the shell.
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
}

type server struct {
	log      *slog.Logger
	path     string
	engine   *script.Engine
	workDir  string
	listener net.Listener
	ctx      context.Context
	cancel   context.CancelFunc
	wg       sync.WaitGroup
}

func newServer(p params) {
	cmds := p.Cmds.Map()
	cmds["help"] = script.DefaultCmds()["help"]
	s := &server{
		log:     p.Log,
		path:    p.Dir.Join(SocketName),
		engine:  &script.Engine{Cmds: cmds},
		workDir: p.Dir.Path(),
	}
	p.Lifecycle.Append(s)
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
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.wg.Add(1)
	go s.accept()
	s.log.Info("Shell listening", "socket", s.path)
	return nil
}

func (s *server) Stop(cell.HookContext) error {
	if s.listener == nil {
		return nil
	}
	s.cancel()
	s.listener.Close()
	s.wg.Wait()
	os.Remove(s.path)
	return nil
}

func (s *server) accept() {
	defer s.wg.Done()
	for {
		conn, err := s.listener.Accept()
		if err != nil {
			if s.ctx.Err() == nil {
				s.log.Error("Shell accept failed", "error", err)
			}
			return
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.serve(conn)
		}()
	}
}

func (s *server) serve(conn net.Conn) {
	ctx, cancel := context.WithCancel(s.ctx)
	defer cancel()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	defer conn.Close()

	state, err := script.NewState(ctx, s.workDir, nil)
	if err != nil {
		s.log.Error("Shell state", "error", err)
		return
	}
	w := &cancelOnErrorWriter{conn: conn, cancel: cancel}
	r := bufio.NewReader(conn)
	for {
		line, _, err := r.ReadLine()
		if err != nil {
			return
		}
		switch string(line) {
		case "stop", "exit", "quit":
			return
		}
		if err := s.execute(state, string(line), w); err != nil {
			fmt.Fprintf(w, "%s%s\n", oneLine(err), errorMarker)
		} else {
			fmt.Fprintln(w, endMarker)
		}
		if ctx.Err() != nil {
			return
		}
	}
}

// execute runs one line; a panicking command becomes an error on the line
// instead of taking the agent down.
func (s *server) execute(state *script.State, line string, w *cancelOnErrorWriter) (err error) {
	defer func() {
		if r := recover(); r != nil {
			s.log.Error("Panic in shell command", "line", line, "panic", r, "stack", string(debug.Stack()))
			err = fmt.Errorf("internal error: %v", r)
		}
	}()
	return s.engine.ExecuteLine(state, line, w)
}

// oneLine keeps an error on a single line, as the client reads the error
// marker at the end of a line.
func oneLine(err error) string {
	b := []byte(err.Error())
	for i, c := range b {
		if c == '\n' || c == '\r' {
			b[i] = ' '
		}
	}
	return string(b)
}

type cancelOnErrorWriter struct {
	conn   net.Conn
	cancel context.CancelFunc
}

func (w *cancelOnErrorWriter) Write(b []byte) (int, error) {
	n, err := w.conn.Write(b)
	if err != nil {
		w.cancel()
	}
	return n, err
}
