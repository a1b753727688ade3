package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/cilium/hive/script"
	"golang.org/x/term"

	"github.com/identityd/identityd/cells/shell"
)

// dialWait is how long the shell client waits for an agent that is not
// listening yet, as the hive's own client does.
const dialWait = 15 * time.Second

// dialShell connects to the agent's shell, retrying while the socket does
// not exist or nobody listens on it (the agent is starting).
func dialShell(ctx context.Context, path string, stderr io.Writer) (*shell.Client, error) {
	ctx, cancel := context.WithTimeout(ctx, dialWait)
	defer cancel()
	for {
		c, err := shell.Dial(ctx, path)
		if err == nil {
			return c, nil
		}
		if !errors.Is(err, os.ErrNotExist) && !errors.Is(err, syscall.ECONNREFUSED) {
			return nil, err
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("no agent answers on %s after %s: %w", path, dialWait, err)
		case <-time.After(time.Second):
			fmt.Fprintf(stderr, "Dialing failed: %s. Retrying...\n", err)
		}
	}
}

// runShellCommand runs the `--` form: args is the argument vector of one
// command, sent as it is.
func runShellCommand(ctx context.Context, path string, stdout, stderr io.Writer, args []string) error {
	// Refuse a bad request before waiting for an agent.
	if _, err := shell.EncodeRequest(args); err != nil {
		return err
	}
	c, err := dialShell(ctx, path, stderr)
	if err != nil {
		return err
	}
	defer c.Close()
	return c.Run(ctx, stdout, args...)
}

// interactiveShell reads commands line by line, each split by shell.Split.
// On a terminal it edits lines and Ctrl-C interrupts the running command;
// from a pipe or file it runs every line and fails if any command failed.
func interactiveShell(ctx context.Context, path string, in io.Reader, stdout, stderr io.Writer) error {
	if f, ok := in.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		return terminalShell(ctx, path, f, stdout)
	}
	r := bufio.NewReader(in)
	var c *shell.Client
	defer func() {
		if c != nil {
			c.Close()
		}
	}()
	failed, total := 0, 0
lines:
	for {
		line, readErr := r.ReadString('\n')
		line = strings.TrimSuffix(strings.TrimSuffix(line, "\n"), "\r")
		if line != "" {
			var err error
			c, err = runLine(ctx, path, c, line, stdout, stderr)
			switch {
			case errors.Is(err, errExit):
				break lines
			case errors.Is(err, errEmpty):
			case err != nil:
				fmt.Fprintf(stderr, "error: %s\n", oneLine(err))
				failed++
				total++
			default:
				total++
			}
		}
		if readErr == io.EOF {
			break
		}
		if readErr != nil {
			return readErr
		}
	}
	if failed > 0 {
		return fmt.Errorf("%d of %d commands failed", failed, total)
	}
	return nil
}

var (
	errExit  = errors.New("exit")
	errEmpty = errors.New("empty line")
)

// runLine runs one typed line on c, dialing first if c is nil. It returns
// the client to use next: nil when the connection broke.
func runLine(ctx context.Context, path string, c *shell.Client, line string, stdout, stderr io.Writer) (*shell.Client, error) {
	args, err := shell.Split(line)
	if err != nil {
		return c, err
	}
	switch {
	case len(args) == 0:
		return c, errEmpty
	case len(args) == 1 && (args[0] == "exit" || args[0] == "quit"):
		return c, errExit
	}
	if _, err := shell.EncodeRequest(args); err != nil {
		return c, err
	}
	if c == nil {
		if c, err = dialShell(ctx, path, stderr); err != nil {
			return nil, err
		}
	}
	err = c.Run(ctx, stdout, args...)
	if err != nil && !errors.As(err, new(*shell.CommandError)) {
		c.Close()
		return nil, err
	}
	return c, err
}

func terminalShell(ctx context.Context, path string, f *os.File, stdout io.Writer) error {
	// Raw mode for line editing, with Ctrl-C still a signal.
	if restore, err := script.MakeRaw(int(f.Fd())); err == nil {
		defer restore()
	}
	console := term.NewTerminal(struct {
		io.Reader
		io.Writer
	}{f, stdout}, "identityd> ")
	// A terminal that reports no size (0x0) keeps the default of 80x24.
	if width, height, err := term.GetSize(int(f.Fd())); err == nil && width > 0 && height > 0 {
		console.SetSize(width, height)
	}
	fmt.Fprintf(console, "identityd shell on %s; 'help' lists the commands, Ctrl-D leaves.\n", path)
	fmt.Fprintf(console, "Words split as in a POSIX shell ('...', \"...\", \\); nothing is expanded.\n")

	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt)
	defer signal.Stop(sigs)
	var c *shell.Client
	defer func() {
		if c != nil {
			c.Close()
		}
	}()
	for {
		line, err := console.ReadLine()
		if err != nil {
			return nil
		}
		// A Ctrl-C at the prompt must not interrupt the next command.
		for len(sigs) > 0 {
			<-sigs
		}
		cmdCtx, cancel := context.WithCancel(ctx)
		go func() {
			select {
			case <-sigs:
				cancel()
			case <-cmdCtx.Done():
			}
		}()
		c, err = runLine(cmdCtx, path, c, line, console, console)
		interrupted := cmdCtx.Err() != nil && ctx.Err() == nil
		cancel()
		switch {
		case errors.Is(err, errExit):
			return nil
		case errors.Is(err, errEmpty):
		case err != nil && interrupted:
			fmt.Fprintln(console, "interrupted")
		case err != nil:
			fmt.Fprintf(console, "error: %s\n", oneLine(err))
		}
	}
}
