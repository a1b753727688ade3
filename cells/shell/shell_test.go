package shell_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/hive/script"
	"github.com/spf13/pflag"
	"go.uber.org/goleak"

	"github.com/identityd/identityd/cells/shell"
	"github.com/identityd/identityd/cells/statedir"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// recorder is a command that records every argument vector it is run
// with and prints it back as JSON.
type recorder struct {
	mu   sync.Mutex
	runs [][]string
}

func (r *recorder) take() [][]string {
	r.mu.Lock()
	defer r.mu.Unlock()
	runs := r.runs
	r.runs = nil
	return runs
}

func (r *recorder) cmd() script.Cmd {
	return script.Command(script.CmdUsage{Summary: "record the arguments", Args: "args..."},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			r.mu.Lock()
			r.runs = append(r.runs, slices.Clone(args))
			r.mu.Unlock()
			out, err := json.Marshal(args)
			if err != nil {
				return nil, err
			}
			return func(*script.State) (string, string, error) { return string(out) + "\n", "", nil }, nil
		})
}

type agent struct {
	sock string
	rec  *recorder
	// blocked receives when test/block runs; the command returns when its
	// context ends, and ended receives then.
	blocked, ended chan struct{}
	stop           func(context.Context) error
}

// startAgent runs a hive with the shell and a few test commands on a
// fresh state directory.
func startAgent(t testing.TB) *agent {
	dir := t.TempDir()
	rec := &recorder{}
	blocked, ended := make(chan struct{}, 1), make(chan struct{}, 1)
	h := hive.New(cell.SimpleHealthCell, job.Cell, statedir.Cell, shell.Cell,
		cell.Provide(func() hive.ScriptCmdsOut {
			return hive.NewScriptCmds(map[string]script.Cmd{
				"test/record": rec.cmd(),
				"test/echo": script.Command(script.CmdUsage{Summary: "echo"},
					func(s *script.State, args ...string) (script.WaitFunc, error) {
						if len(args) > 0 && args[0] == "fail" {
							return nil, os.ErrInvalid
						}
						if len(args) > 0 && args[0] == "usage" {
							return nil, script.ErrUsage
						}
						if len(args) > 0 && args[0] == "panic" {
							panic("boom")
						}
						out := strings.Join(args, " ") + "\n"
						return func(*script.State) (string, string, error) { return out, "", nil }, nil
					}),
				"test/flags": script.Command(
					script.CmdUsage{
						Summary: "print a flag and the arguments",
						Flags:   func(fs *pflag.FlagSet) { fs.StringP("output", "o", "table", "format") },
					},
					func(s *script.State, args ...string) (script.WaitFunc, error) {
						o, _ := s.Flags.GetString("output")
						out, _ := json.Marshal(append([]string{o}, args...))
						return func(*script.State) (string, string, error) { return string(out) + "\n", "", nil }, nil
					}),
				"test/env": script.Command(script.CmdUsage{Summary: "expand a variable the way a command could"},
					func(s *script.State, args ...string) (script.WaitFunc, error) {
						out := s.ExpandEnv("[$SHELL_TEST_SECRET]", false)
						if _, ok := s.LookupEnv("SHELL_TEST_SECRET"); ok {
							out += " found"
						}
						return func(*script.State) (string, string, error) { return out + "\n", "", nil }, nil
					}),
				"test/block": script.Command(script.CmdUsage{Summary: "block until the command's context ends"},
					func(s *script.State, args ...string) (script.WaitFunc, error) {
						blocked <- struct{}{}
						<-s.Context().Done()
						select {
						case ended <- struct{}{}:
						default:
						}
						return nil, s.Context().Err()
					}),
				"test/log": script.Command(script.CmdUsage{Summary: "log while running"},
					func(s *script.State, args ...string) (script.WaitFunc, error) {
						s.Logf("first\n")
						if err := s.FlushLog(); err != nil {
							return nil, err
						}
						s.Logf("second\n")
						return nil, nil
					}),
			})
		}))
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	log := hivetest.Logger(t)
	if err := h.Start(log, context.Background()); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	stop := func(ctx context.Context) (err error) {
		once.Do(func() { err = h.Stop(log, ctx) })
		return err
	}
	t.Cleanup(func() { stop(context.Background()) })
	return &agent{sock: filepath.Join(dir, shell.SocketName), rec: rec, blocked: blocked, ended: ended, stop: stop}
}

func dial(t testing.TB, a *agent) *shell.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := shell.Dial(ctx, a.sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func run(t testing.TB, c *shell.Client, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var out strings.Builder
	err := c.Run(ctx, &out, args...)
	return out.String(), err
}

func TestShell(t *testing.T) {
	a := startAgent(t)
	fi, err := os.Stat(a.sock)
	if err != nil || fi.Mode().Perm() != 0o600 || fi.Mode()&os.ModeSocket == 0 {
		t.Fatalf("socket %v, %v; want a 0600 socket", fi, err)
	}
	c := dial(t, a)
	if out, err := run(t, c, "test/echo", "hello", "world"); err != nil || out != "hello world\n" {
		t.Fatalf("echo: %v %q", err, out)
	}
	if out, err := run(t, c, "help"); err != nil || !strings.Contains(out, "test/echo") || !strings.Contains(out, "help") {
		t.Fatalf("help: %v %q", err, out)
	}
	if out, err := run(t, c, "help", "test/flags"); err != nil || !strings.Contains(out, "--output") || strings.Contains(out, "test/echo") {
		t.Fatalf("help test/flags: %v %q", err, out)
	}
	// A failing command is a *CommandError on one line; the connection
	// and the server live on.
	var cmdErr *shell.CommandError
	if _, err := run(t, c, "test/echo", "fail"); !errors.As(err, &cmdErr) || cmdErr.Msg != "test/echo: invalid argument" {
		t.Fatalf("failing command: %v", err)
	}
	if _, err := run(t, c, "test/echo", "usage"); err == nil || !strings.Contains(err.Error(), "usage: test/echo") {
		t.Fatalf("usage error: %v", err)
	}
	if _, err := run(t, c, "test/echo", "panic"); !errors.As(err, &cmdErr) || !strings.Contains(err.Error(), "boom") {
		t.Fatalf("panicking command: %v", err)
	}
	if _, err := run(t, c, "no/such"); !errors.As(err, &cmdErr) || !strings.Contains(err.Error(), `unknown command "no/such"`) {
		t.Fatalf("unknown command: %v", err)
	}
	// Output the command flushes while it runs comes before the rest.
	if out, err := run(t, c, "test/log"); err != nil || out != "first\nsecond\n" {
		t.Fatalf("log: %v %q", err, out)
	}
	// Output that ended an answer in the hive's line protocol is output.
	if out, err := run(t, c, "test/echo", "a<<error>>\n[stdout]\nb<<end>>"); err != nil || out != "a<<error>>\n[stdout]\nb<<end>>\n" {
		t.Fatalf("output with the old markers: %v %q", err, out)
	}
	if out, err := run(t, c, "test/echo", "still", "here"); err != nil || out != "still here\n" {
		t.Fatalf("after errors: %v %q", err, out)
	}
}

// TestArgumentsVerbatim: each argument vector reaches the command exactly,
// once, whatever its bytes; nothing else runs.
func TestArgumentsVerbatim(t *testing.T) {
	a := startAgent(t)
	c := dial(t, a)
	for _, args := range [][]string{
		{"k8s:app=a b"},
		{"$HOME", "${PATH}", "$", "$$", "$(id)", "`id`", "${:}", "${/}"},
		{"#", "# comment", "a#b", "#!"},
		{"'", `"`, `'a b'`, `"a b"`, "''", `\`, `\'`, "it's"},
		{"a\tb", "a\nb", "a\r\nb", "\n", "x\ntest/record injected", "\x00", "\x7f"},
		{"!", "?", "*", "!*", "[linux]", "[!root]", "&"},
		{"", "", ""},
		{"--", "-h", "--help", "--autocomplete=x", "-o", "json"},
		{"żółw 🐢", "\u2028\u2029", "<>&", "\ufeff"},
		{"k8s:pad=" + strings.Repeat("x", 5000)},
		{strings.Repeat("y", 4096-len(`["test/record",`)) + "test/record injected"},
		{strings.Repeat("z", 900_000)},
		{},
	} {
		out, err := run(t, c, append([]string{"test/record"}, args...)...)
		want := args
		if want == nil {
			want = []string{}
		}
		wantOut, _ := json.Marshal(want)
		if err != nil || out != string(wantOut)+"\n" {
			t.Errorf("test/record %.200q: %v, output %.200q", args, err, out)
		}
		if runs := a.rec.take(); len(runs) != 1 || !slices.Equal(runs[0], want) {
			t.Errorf("test/record %.200q: runs %.300q, want exactly the arguments once", args, runs)
		}
	}
}

// TestEnvironmentNeverReachesCommands: the agent's environment is not the
// shell's, so even a command that expands variables finds none of it.
func TestEnvironmentNeverReachesCommands(t *testing.T) {
	t.Setenv("SHELL_TEST_SECRET", "leaked")
	a := startAgent(t)
	c := dial(t, a)
	if out, err := run(t, c, "test/env"); err != nil || out != "[]\n" {
		t.Fatalf("test/env: %v %q, want the variable unknown", err, out)
	}
	if out, err := run(t, c, "test/record", "$SHELL_TEST_SECRET"); err != nil || out != `["$SHELL_TEST_SECRET"]`+"\n" {
		t.Fatalf("test/record: %v %q", err, out)
	}
}

// TestFlags: a command that declares flags gets them parsed as in a
// script, and -h shows its help instead of running it.
func TestFlags(t *testing.T) {
	a := startAgent(t)
	c := dial(t, a)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"a", "b"}, `["table","a","b"]`},
		{[]string{"-o", "json", "a b"}, `["json","a b"]`},
		{[]string{"a", "--output=yaml"}, `["yaml","a"]`},
		{[]string{"--", "-o", "x"}, `["table","-o","x"]`},
		{[]string{"-o", "$HOME #"}, `["$HOME #"]`},
	} {
		out, err := run(t, c, append([]string{"test/flags"}, tc.args...)...)
		if err != nil || out != tc.want+"\n" {
			t.Errorf("test/flags %q: %v %q, want %s", tc.args, err, out, tc.want)
		}
	}
	if out, err := run(t, c, "test/flags", "-h"); err != nil || !strings.Contains(out, "--output") {
		t.Errorf("test/flags -h: %v %q", err, out)
	}
	if _, err := run(t, c, "test/flags", "--nope"); err == nil || !strings.Contains(err.Error(), "unknown flag: --nope") {
		t.Errorf("test/flags --nope: %v", err)
	}
}

// TestRequestLimit: a request of MaxRequestBytes runs; one byte more is
// refused whole by the client, and by the server from a client that sends
// it anyway, which then serves the next request on the same connection.
func TestRequestLimit(t *testing.T) {
	a := startAgent(t)
	c := dial(t, a)
	overhead := len(`["test/record",""]`)
	fits := strings.Repeat("x", shell.MaxRequestBytes-overhead)
	if _, err := run(t, c, "test/record", fits); err != nil {
		t.Fatalf("request of exactly MaxRequestBytes: %v", err)
	}
	if runs := a.rec.take(); len(runs) != 1 || runs[0][0] != fits {
		t.Fatalf("request of exactly MaxRequestBytes: %d runs", len(runs))
	}
	if _, err := run(t, c, "test/record", fits+"x"); !errors.Is(err, shell.ErrRequestTooLarge) ||
		!strings.Contains(err.Error(), "at most 1048576 allowed") {
		t.Fatalf("request one byte over the limit: %v", err)
	}
	// Escapes count: a newline is two bytes of JSON.
	if _, err := run(t, c, "test/record", strings.Repeat("\n", shell.MaxRequestBytes/2)); !errors.Is(err, shell.ErrRequestTooLarge) {
		t.Fatalf("request over the limit by its escapes: %v", err)
	}

	conn := rawConn(t, a)
	// Over the limit, with what looks like a second command after the
	// point where the old line protocol cut it.
	huge := `["test/record","` + strings.Repeat("x", shell.MaxRequestBytes) + `"]` + "\n"
	if got := conn.exchange(t, huge); got.End != "error" || !strings.Contains(got.Error, "at most 1048576 allowed; nothing ran") {
		t.Fatalf("oversized request: %+v", got)
	}
	if got := conn.exchange(t, `["test/record","next"]`+"\n"); got.End != "ok" {
		t.Fatalf("request after an oversized one: %+v", got)
	}
	if runs := a.rec.take(); len(runs) != 1 || !slices.Equal(runs[0], []string{"next"}) {
		t.Fatalf("runs %.200q, want only the request after the oversized one", runs)
	}
}

// TestRawRequests: what a client other than ours may send. Anything that
// is not exactly one JSON array of strings in UTF-8 is refused and runs
// nothing; the connection serves the next request.
func TestRawRequests(t *testing.T) {
	a := startAgent(t)
	conn := rawConn(t, a)
	for _, tc := range []struct {
		req  string
		want []string // nil: refused
	}{
		{"test/record a b", nil},
		{`["test/record","a"] ["test/record","b"]`, nil},
		{`["test/record","a"],["test/record","b"]`, nil},
		{`[]`, nil},
		{`null`, nil},
		{`{"args":["test/record"]}`, nil},
		{`["test/record",null]`, nil},
		{`["test/record",1]`, nil},
		{`["test/record",["a"]]`, nil},
		{`[""]`, nil},
		{"[\"test/record\",\"\xff\"]", nil},
		{`["test/record","\ud800"]`, nil},
		{`["test/record","\udc22"]`, nil},
		{`["test/record","\ud83d"]`, nil},
		{`["test/record","\ud83dx"]`, nil},
		{`["test/record","\ud83d\u0041"]`, nil},
		{`["test/record","\ud83d\udc22", "\u00e9\"\\\/\n"]`, []string{"🐢", "é\"\\/\n"}},
		{` [ "test/record" , "a b" ] `, []string{"a b"}},
		{`["test/record","a\r"]` + "\r", []string{"a\r"}},
	} {
		got := conn.exchange(t, tc.req+"\n")
		runs := a.rec.take()
		if tc.want == nil {
			if got.End != "error" || len(runs) != 0 {
				t.Errorf("request %q: answer %+v, runs %q; want refused", tc.req, got, runs)
			}
			continue
		}
		if got.End != "ok" || len(runs) != 1 || !slices.Equal(runs[0], tc.want) {
			t.Errorf("request %q: answer %+v, runs %q; want %q once", tc.req, got, runs, tc.want)
		}
	}
	// A connection that ends inside a request runs nothing of it.
	if _, err := conn.Write([]byte(`["test/record","cut"]`)); err != nil {
		t.Fatal(err)
	}
	conn.Close()
	if _, err := run(t, dial(t, a), "test/echo", "x"); err != nil {
		t.Fatal(err)
	}
	if runs := a.rec.take(); len(runs) != 0 {
		t.Fatalf("runs %q after a request without its newline", runs)
	}
}

type raw struct {
	net.Conn
	r *bufio.Reader
}

func rawConn(t *testing.T, a *agent) *raw {
	conn, err := net.Dial("unix", a.sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &raw{Conn: conn, r: bufio.NewReaderSize(conn, 1<<16)}
}

type answer struct {
	Output string `json:"output"`
	End    string `json:"end"`
	Error  string `json:"error"`
}

// exchange sends req and returns the answer's end frame, with the output
// before it.
func (c *raw) exchange(t *testing.T, req string) answer {
	t.Helper()
	c.SetDeadline(time.Now().Add(30 * time.Second))
	if _, err := c.Write([]byte(req)); err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	for {
		line, err := c.r.ReadBytes('\n')
		if err != nil {
			t.Fatalf("answer to %.100q: %v", req, err)
		}
		var f answer
		if err := json.Unmarshal(line, &f); err != nil {
			t.Fatalf("answer to %.100q: frame %q: %v", req, line, err)
		}
		out.WriteString(f.Output)
		if f.End != "" {
			f.Output = out.String()
			return f
		}
	}
}

// TestClientInterrupted: ending the context of a running command returns
// at once and breaks the Client, whose next command is refused instead of
// reading the interrupted command's answer.
func TestClientInterrupted(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "s.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	// A server that reads requests and never answers.
	go func() {
		conn, err := l.Accept()
		if err != nil {
			return
		}
		defer conn.Close()
		buf := make([]byte, 4096)
		for {
			if _, err := conn.Read(buf); err != nil {
				return
			}
		}
	}()
	c, err := shell.Dial(t.Context(), sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancel()
	if err := c.Run(ctx, &strings.Builder{}, "test/echo"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("interrupted run: %v", err)
	}
	if err := c.Run(t.Context(), &strings.Builder{}, "test/echo"); err == nil || !strings.Contains(err.Error(), "unusable") {
		t.Fatalf("run after an interrupted one: %v", err)
	}
}

// TestStopEndsCommandsInFlight: the accept job serves each connection on
// its context, so the hive's stop ends a command still running, closes
// its connection and removes the socket, instead of waiting for it.
func TestStopEndsCommandsInFlight(t *testing.T) {
	a := startAgent(t)
	c := dial(t, a)
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		done <- c.Run(ctx, io.Discard, "test/block")
	}()
	select {
	case <-a.blocked:
	case <-time.After(30 * time.Second):
		t.Fatal("test/block did not run")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := a.stop(ctx); err != nil {
		t.Fatalf("stop with a command in flight: %v", err)
	}
	// The stop closed the connection: the command's answer is an error,
	// well before the client's own minute is up.
	if err := <-done; err == nil || errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("command in flight at stop: %v", err)
	}
	if _, err := os.Stat(a.sock); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket after stop: %v", err)
	}
}

// TestClientGoneEndsCommand: a command that waits and writes nothing ends
// when its client closes the connection, as a probe or a script that gives
// up does; a client that only shuts down its sending side, as socat and nc
// do at the end of their input, still gets its answer.
func TestClientGoneEndsCommand(t *testing.T) {
	a := startAgent(t)
	waitBlocked := func() {
		t.Helper()
		select {
		case <-a.blocked:
		case <-time.After(30 * time.Second):
			t.Fatal("test/block did not run")
		}
	}
	// closeEnds closes conn and waits for test/block to end.
	closeEnds := func(conn net.Conn) {
		t.Helper()
		conn.Close()
		select {
		case <-a.ended:
		case <-time.After(10 * time.Second):
			t.Fatal("test/block still runs 10s after its client closed the connection")
		}
	}

	conn := dialUnix(t, a)
	if _, err := conn.Write([]byte(`["test/block"]` + "\n")); err != nil {
		t.Fatal(err)
	}
	waitBlocked()
	closeEnds(conn)

	half := dialUnix(t, a)
	if _, err := half.Write([]byte(`["test/echo","still","answered"]` + "\n")); err != nil {
		t.Fatal(err)
	}
	if err := half.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	half.SetReadDeadline(time.Now().Add(30 * time.Second))
	answer, err := io.ReadAll(half)
	if err != nil || !strings.Contains(string(answer), "still answered") || !strings.Contains(string(answer), `"end":"ok"`) {
		t.Fatalf("answer after the client shut down its sending side: %q, %v", answer, err)
	}
	half.Close()

	half = dialUnix(t, a)
	if _, err := half.Write([]byte(`["test/block"]` + "\n")); err != nil {
		t.Fatal(err)
	}
	waitBlocked()
	if err := half.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-a.ended:
		t.Fatal("test/block ended when its client only shut down its sending side")
	case <-time.After(time.Second):
	}
	closeEnds(half)
}

// dialUnix connects to the agent's socket without a client on top.
func dialUnix(t *testing.T, a *agent) *net.UnixConn {
	t.Helper()
	conn, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: a.sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}
