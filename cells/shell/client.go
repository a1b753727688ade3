package shell

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"time"
)

// CommandError is the agent's answer that a command failed, or that it
// refused the request: the outcome is known, unlike a broken connection's.
type CommandError struct{ Msg string }

func (e *CommandError) Error() string { return e.Msg }

// Client is one connection to an agent's shell. It runs one command at a
// time; after an error other than a *CommandError the connection is in an
// unknown state and the Client refuses further commands.
type Client struct {
	conn   net.Conn
	dec    *json.Decoder
	broken error
}

// Dial connects to the shell socket at path.
func Dial(ctx context.Context, path string) (*Client, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, err
	}
	return &Client{conn: conn, dec: json.NewDecoder(conn)}, nil
}

// Close closes the connection.
func (c *Client) Close() error { return c.conn.Close() }

// SetDeadline bounds the commands run from now on, as net.Conn's
// SetDeadline does: past it, Run fails and the Client is broken.
func (c *Client) SetDeadline(t time.Time) error { return c.conn.SetDeadline(t) }

// Run runs the command args[0] with the arguments args[1:], exactly as
// given, and copies its output to w as it comes. A *CommandError says the
// command failed or the agent refused the request (nothing ran then). An
// error wrapping ErrRequestTooLarge or ErrBadRequest says the request was
// not sent. Any other error (the connection broke, ctx ended, the deadline
// passed) leaves unknown whether the command ran.
func (c *Client) Run(ctx context.Context, w io.Writer, args ...string) error {
	req, err := EncodeRequest(args)
	if err != nil {
		return err
	}
	if c.broken != nil {
		return fmt.Errorf("shell connection unusable after an earlier error: %w", c.broken)
	}
	// Ending ctx unblocks the reads and writes below.
	stop := context.AfterFunc(ctx, func() { c.conn.SetDeadline(time.Unix(1, 0)) })
	err = c.exchange(req, w)
	interrupted := !stop()
	if err != nil && !errors.As(err, new(*CommandError)) {
		if interrupted {
			err = fmt.Errorf("%w (%w)", ctx.Err(), err)
		}
		c.broken = err
	} else if interrupted {
		// The answer was complete, but the deadline set to interrupt
		// the exchange now fails the next one.
		c.broken = ctx.Err()
	}
	return err
}

func (c *Client) exchange(req []byte, w io.Writer) error {
	if _, err := c.conn.Write(req); err != nil {
		// A server that refused the connection (too many open) wrote
		// why before it closed: that says more than the broken pipe.
		var f frame
		if c.dec.Decode(&f) == nil && f.End == endError {
			return fmt.Errorf("sending the request: %w", &CommandError{Msg: f.Error})
		}
		return fmt.Errorf("sending the request: %w", err)
	}
	for {
		var f frame
		if err := c.dec.Decode(&f); err != nil {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return fmt.Errorf("reading the answer: %w", err)
		}
		if f.Output != "" {
			if _, err := io.WriteString(w, f.Output); err != nil {
				return fmt.Errorf("writing the output: %w", err)
			}
		}
		switch f.End {
		case "":
		case endOK:
			return nil
		case endError:
			return &CommandError{Msg: f.Error}
		default:
			return fmt.Errorf("reading the answer: unknown end %q", f.End)
		}
	}
}
