package robustness

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/identityd/identityd/cells/shell"
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
	c *shell.Client
}

// DialShell connects to the shell socket at path.
func DialShell(path string, timeout time.Duration) (*Shell, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	c, err := shell.Dial(ctx, path)
	if err != nil {
		return nil, err
	}
	return &Shell{c: c}, nil
}

// DecodeList decodes the JSON list a command printed with -o json (after
// any lines before it, such as "allocated new identity N").
func DecodeList[T any](out string) ([]T, error) {
	i := strings.Index(out, "[")
	if i < 0 {
		return nil, fmt.Errorf("no JSON list in %q", out)
	}
	var list []T
	if err := json.Unmarshal([]byte(out[i:]), &list); err != nil {
		return nil, fmt.Errorf("decoding %q: %w", out, err)
	}
	return list, nil
}

// Close closes the connection.
func (s *Shell) Close() error { return s.c.Close() }

// Run runs one command, args[0] with the arguments args[1:] as they are,
// and returns its output. A *CommandError says the command failed; any
// other error means the outcome is unknown (the connection broke or the
// answer did not come before deadline), and the Shell must be closed.
func (s *Shell) Run(deadline time.Time, args ...string) (string, error) {
	s.c.SetDeadline(deadline)
	var out strings.Builder
	err := s.c.Run(context.Background(), &out, args...)
	if cmdErr := (*shell.CommandError)(nil); errors.As(err, &cmdErr) {
		return out.String(), &CommandError{Msg: cmdErr.Msg}
	}
	return out.String(), err
}
