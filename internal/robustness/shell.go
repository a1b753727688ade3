package robustness

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"strings"
	"time"
)

// Markers of the hive shell protocol (github.com/cilium/hive/shell): the
// agent ends a command's output with a line ending in one of them.
const (
	endMarker    = "<<end>>"
	errorMarker  = "<<error>>"
	stdoutMarker = "[stdout]"
	stderrMarker = "[stderr]"
)

// CommandError is a command the agent ran and that failed: its outcome is
// known, unlike a broken connection's.
type CommandError struct{ Msg string }

func (e *CommandError) Error() string { return e.Msg }

// Shell is one connection to an agent's shell socket. Running commands over
// one connection instead of a process per command keeps the client's cost
// small next to the agent's, so the workload measures the agent. A Shell
// runs one command at a time.
type Shell struct {
	conn net.Conn
	r    *bufio.Reader
}

// DialShell connects to the shell socket at path.
func DialShell(path string, timeout time.Duration) (*Shell, error) {
	conn, err := net.DialTimeout("unix", path, timeout)
	if err != nil {
		return nil, err
	}
	return &Shell{conn: conn, r: bufio.NewReaderSize(conn, 64<<10)}, nil
}

// Close closes the connection; the agent cancels a command still running
// on it.
func (s *Shell) Close() error { return s.conn.Close() }

// Run sends one command line and returns its output. A *CommandError says
// the command failed; any other error means the outcome is unknown (the
// connection broke or the answer did not come before deadline), and the
// Shell must be closed.
func (s *Shell) Run(line string, deadline time.Time) (string, error) {
	if strings.ContainsAny(line, "\r\n") {
		return "", fmt.Errorf("command line holds a line break: %q", line)
	}
	s.conn.SetDeadline(deadline)
	if _, err := s.conn.Write([]byte(line + "\n")); err != nil {
		return "", err
	}
	var out strings.Builder
	for {
		l, err := s.r.ReadString('\n')
		if err != nil {
			if errors.Is(err, net.ErrClosed) || l == "" {
				return out.String(), fmt.Errorf("reading the answer to %q: %w", line, err)
			}
			return out.String(), fmt.Errorf("reading the answer to %q: %w (partial line %q)", line, err, l)
		}
		l = strings.TrimSuffix(l, "\n")
		if l == stdoutMarker || l == stderrMarker {
			continue
		}
		if rest, ok := strings.CutSuffix(l, endMarker); ok {
			out.WriteString(rest)
			return out.String(), nil
		}
		if rest, ok := strings.CutSuffix(l, errorMarker); ok {
			return out.String(), &CommandError{Msg: rest}
		}
		out.WriteString(l)
		out.WriteByte('\n')
	}
}
