package testproc

import (
	"debug/buildinfo"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

func TestSourceKeyFollowsSources(t *testing.T) {
	root := t.TempDir()
	write := func(path, content string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(filepath.Join(root, path)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, path), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	var flags []string
	key := func() string {
		t.Helper()
		k, err := sourceKey(root, "cmd/x", flags)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	write("go.mod", "module m\n")
	write("cmd/x/main.go", "package main\n\nfunc main() {}\n")
	k0 := key()
	if key() != k0 {
		t.Fatal("key of unchanged sources changed")
	}
	for _, change := range [][2]string{
		{"cmd/x/main.go", "package main\n\nfunc main() { println() }\n"},
		{"cmd/x/extra.go", "package main\n"},
		{"go.sum", "example.com/m v1.0.0 h1:x=\n"},
		{"go.mod", "module m\n\ngo 1.26\n"},
	} {
		write(change[0], change[1])
		if k := key(); k == k0 {
			t.Errorf("key unchanged after writing %s", change[0])
		} else {
			k0 = k
		}
	}
	for _, change := range [][]string{{"-gcflags=example.com/...=-N"}, {"-gcflags=example.com/...=-N -l"}, {"-gcflags=example.com/...=-N", "-l"}} {
		flags = change
		if k := key(); k == k0 {
			t.Errorf("key unchanged after build flags %q", change)
		} else {
			k0 = k
		}
	}
	if _, err := sourceKey(root, "cmd/none", nil); err == nil {
		t.Error("no error for a package without Go files")
	}
}

func TestFreePortsDistinct(t *testing.T) {
	ports, err := FreePorts(20)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int]bool{}
	for _, p := range ports {
		if seen[p] || p <= 0 {
			t.Fatalf("ports %v: %d repeated or invalid", ports, p)
		}
		seen[p] = true
	}
}

// TestBinaryBuiltAsTheImage: the servers are built in the image's mode
// (static, -trimpath), which the agents and the image's binary share, so
// that a fresh machine compiles the dependencies in that mode only once.
func TestBinaryBuiltAsTheImage(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the test etcd server")
	}
	bin, err := Binary(time.Time{}, "etcd", "internal/etcdtest/etcdserver", "")
	if err != nil {
		t.Fatal(err)
	}
	info, err := buildinfo.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	settings := map[string]string{}
	for _, s := range info.Settings {
		settings[s.Key] = s.Value
	}
	if settings["CGO_ENABLED"] != "0" || settings["-trimpath"] != "true" {
		t.Errorf("%s built with CGO_ENABLED=%q -trimpath=%q, want 0 and true (the Dockerfile's)", bin, settings["CGO_ENABLED"], settings["-trimpath"])
	}
}

// TestBuildLockExcludes: a WithBuildLock waits while another holds the
// lock. flock conflicts between two opens of the file, in one process as
// between two test binaries, so the goroutines here stand for the test
// binaries that go test runs in parallel.
func TestBuildLockExcludes(t *testing.T) {
	t.Setenv("XDG_CACHE_HOME", t.TempDir())
	held, release := make(chan struct{}), make(chan struct{})
	first := make(chan error, 1)
	go func() {
		first <- WithBuildLock(func() error {
			close(held)
			<-release
			return nil
		})
	}()
	<-held
	var released atomic.Bool
	second := make(chan error, 1)
	go func() {
		second <- WithBuildLock(func() error {
			if !released.Load() {
				return errors.New("ran while the first holder had the lock")
			}
			return nil
		})
	}()
	select {
	case err := <-second:
		t.Fatalf("second WithBuildLock returned while the first held the lock: %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	released.Store(true)
	close(release)
	for _, c := range []chan error{first, second} {
		if err := <-c; err != nil {
			t.Fatal(err)
		}
	}
}

// TestBuildAgentLinksOnce: BuildAgent into two directories gives each its
// own copy of one binary, linked once: the second build finds the
// checkout's shared binary up to date and leaves that file alone. An
// agent of another checkout unused for a day is deleted; a recent one
// stays.
func TestBuildAgentLinksOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the agent")
	}
	gocache, err := exec.Command("go", "env", "GOCACHE").Output()
	if err != nil {
		t.Fatal(err)
	}
	// The build cache stays where it is; only testproc's cache moves.
	t.Setenv("GOCACHE", strings.TrimSpace(string(gocache)))
	t.Setenv("XDG_CACHE_HOME", t.TempDir())

	first, err := BuildAgent(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	shared, err := sharedAgentPath()
	if err != nil {
		t.Fatal(err)
	}
	before, err := os.Stat(shared)
	if err != nil {
		t.Fatalf("the shared agent: %v", err)
	}
	agents := filepath.Dir(filepath.Dir(shared))
	other := func(name string, age time.Duration) string {
		t.Helper()
		bin := filepath.Join(agents, name, "identityd")
		if err := os.MkdirAll(filepath.Dir(bin), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(bin, []byte("another checkout's agent"), 0o755); err != nil {
			t.Fatal(err)
		}
		when := time.Now().Add(-age)
		if err := os.Chtimes(bin, when, when); err != nil {
			t.Fatal(err)
		}
		return bin
	}
	stale, recent := other("stale", 25*time.Hour), other("recent", time.Hour)

	second, err := BuildAgent(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	after, err := os.Stat(shared)
	if err != nil {
		t.Fatal(err)
	}
	if !os.SameFile(before, after) {
		t.Error("the second BuildAgent replaced the shared binary: it linked the agent again")
	}
	a, b := mustStat(t, first), mustStat(t, second)
	if first == second || os.SameFile(a, b) || os.SameFile(a, after) {
		t.Errorf("the two builds did not give two copies: %s, %s", first, second)
	}
	if a.Size() != after.Size() || b.Size() != after.Size() || a.Mode()&0o111 == 0 || b.Mode()&0o111 == 0 {
		t.Errorf("copies: %v %v, shared binary: %v", a.Mode(), b.Mode(), after.Mode())
	}
	if out, err := exec.Command(second, "version").CombinedOutput(); err != nil {
		t.Errorf("%s version: %v\n%s", second, err, out)
	}
	if _, err := os.Stat(stale); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("an agent unused for 25 hours is still there: %v", err)
	}
	if _, err := os.Stat(recent); err != nil {
		t.Errorf("an agent used an hour ago is gone: %v", err)
	}
}

func mustStat(t *testing.T, path string) os.FileInfo {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi
}

// fatalRecorder is a testing.TB whose Fatalf records the message and ends
// the call with a panic that the test recovers.
type fatalRecorder struct {
	testing.TB
	msg string
}

type fatalCalled struct{}

func (r *fatalRecorder) Helper() {}
func (r *fatalRecorder) Fatalf(format string, args ...any) {
	r.msg = fmt.Sprintf(format, args...)
	panic(fatalCalled{})
}

func TestCountFromEnv(t *testing.T) {
	const name = "TESTPROC_COUNT"
	count := func(value string) (n int, fatal string) {
		t.Setenv(name, value)
		r := &fatalRecorder{TB: t}
		defer func() {
			if v := recover(); v != nil {
				if _, ok := v.(fatalCalled); !ok {
					panic(v)
				}
				fatal = r.msg
			}
		}()
		return CountFromEnv(r, name, 7, 3), ""
	}
	for _, c := range []struct {
		value string
		want  int
		fatal bool
	}{
		{"", 7, false},
		{"3", 3, false},
		{"2000", 2000, false},
		{"2", 0, true},
		{"x", 0, true},
		{"1e3", 0, true},
		{"-5", 0, true},
	} {
		n, fatal := count(c.value)
		if c.fatal {
			if !strings.Contains(fatal, name+"=") {
				t.Errorf("%q: want a failure naming %s, got %d, %q", c.value, name, n, fatal)
			}
			continue
		}
		if fatal != "" || n != c.want {
			t.Errorf("%q: got %d, %q; want %d", c.value, n, fatal, c.want)
		}
	}
}

// TestBuildStoppedBeforeDeadline: a server's build that would run past its
// test's deadline (less DeadlineReserve) is stopped with the processes it
// started, and the error says what to run first; a deadline already
// inside the reserve starts no build, and neither does one reached while
// another holds the build lock.
func TestBuildStoppedBeforeDeadline(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a build of the test etcd server")
	}
	t.Setenv("XDG_CACHE_HOME", t.TempDir()) // nothing built yet
	// An empty build cache, so that the build compiles for longer than
	// it is given.
	gocache := t.TempDir()
	t.Setenv("GOCACHE", gocache)
	const pkg = "internal/etcdtest/etcdserver"

	check := func(err error, within time.Duration, began time.Time) {
		t.Helper()
		if !errors.Is(err, ErrBuildTooLong) {
			t.Fatalf("err = %v, want ErrBuildTooLong", err)
		}
		if !strings.Contains(err.Error(), PrebuildCommand) || strings.Contains(err.Error(), "\n") {
			t.Errorf("error %q is not one line naming %q", err, PrebuildCommand)
		}
		if d := time.Since(began); d > within {
			t.Errorf("returned after %s, want within %s", d, within)
		}
	}

	began := time.Now()
	_, err := build(time.Now().Add(DeadlineReserve/2), "etcd", "", pkg, "IDENTITYD_ETCD_BINARY", nil)
	check(err, time.Second, began)
	if n := processesWithEnv(t, "GOCACHE="+gocache); n != 0 {
		t.Fatalf("%d processes of a build that should not have started", n)
	}

	// Long enough for the go command to start its compilers.
	began = time.Now()
	_, err = build(time.Now().Add(DeadlineReserve+4*time.Second), "etcd", "", pkg, "IDENTITYD_ETCD_BINARY", nil)
	check(err, 15*time.Second, began)
	// The kernel delivers the group's SIGKILL to each compiler on its own;
	// a compiler left running would go on for seconds.
	deadline := time.Now().Add(time.Second)
	for n := processesWithEnv(t, "GOCACHE="+gocache); n != 0; n = processesWithEnv(t, "GOCACHE="+gocache) {
		if time.Now().After(deadline) {
			t.Fatalf("%d processes of the stopped build still run", n)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if matches, _ := filepath.Glob(filepath.Join(os.Getenv("XDG_CACHE_HOME"), "identityd-testbin", "etcd-*")); len(matches) != 0 {
		t.Errorf("the stopped build left %v", matches)
	}

	held, release := make(chan struct{}), make(chan struct{})
	go WithBuildLock(func() error { close(held); <-release; return nil })
	<-held
	defer close(release)
	began = time.Now()
	_, err = build(time.Now().Add(DeadlineReserve+time.Second), "etcd", "", pkg, "IDENTITYD_ETCD_BINARY", nil)
	check(err, 10*time.Second, began)
}

// processesWithEnv counts this user's processes whose environment holds
// the variable setting kv.
func processesWithEnv(t *testing.T, kv string) int {
	t.Helper()
	dirs, err := filepath.Glob("/proc/[0-9]*/environ")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, f := range dirs {
		b, err := os.ReadFile(f)
		if err != nil {
			continue // gone, or another user's
		}
		for _, v := range strings.Split(string(b), "\x00") {
			if v == kv {
				n++
				break
			}
		}
	}
	return n
}

// TestModuleBinaryWithoutItsModule: a module that is not in the source
// fails with an error that names it and the variable to set, and builds
// nothing.
func TestModuleBinaryWithoutItsModule(t *testing.T) {
	t.Setenv("XDG_CACHE_HOME", t.TempDir())
	_, err := ModuleBinary(time.Time{}, "absent", "internal/no-such-module", "IDENTITYD_ABSENT_BINARY")
	if err == nil || !strings.Contains(err.Error(), "IDENTITYD_ABSENT_BINARY") || !strings.Contains(err.Error(), "internal/no-such-module") {
		t.Fatalf("err = %v, want one naming the module and IDENTITYD_ABSENT_BINARY", err)
	}
	t.Setenv("IDENTITYD_ABSENT_BINARY", "/bin/true")
	if p, err := ModuleBinary(time.Time{}, "absent", "internal/no-such-module", "IDENTITYD_ABSENT_BINARY"); err != nil || p != "/bin/true" {
		t.Fatalf("with the variable set: %q, %v; want /bin/true", p, err)
	}
}

// TestModuleSourceFromCopy: a module kept with ModuleSource's suffix is
// written out whole, once per content, from any copy of this module's
// source, such as a module cache's, which would hold no nested module.
func TestModuleSourceFromCopy(t *testing.T) {
	t.Setenv("XDG_CACHE_HOME", t.TempDir())
	root := t.TempDir()
	mod := filepath.Join(root, "kept")
	if err := os.Mkdir(mod, 0o755); err != nil {
		t.Fatal(err)
	}
	files := map[string]string{
		"go.mod.in":  "module example.com/kept\n\ngo 1.22\n",
		"main.go.in": "package main\n\nfunc main() {}\n",
	}
	for n, c := range files {
		if err := os.WriteFile(filepath.Join(mod, n), []byte(c), 0o444); err != nil {
			t.Fatal(err)
		}
	}
	dir, err := moduleSource(root, "kept")
	if err != nil {
		t.Fatal(err)
	}
	for n, c := range files {
		b, err := os.ReadFile(filepath.Join(dir, strings.TrimSuffix(n, ".in")))
		if err != nil || string(b) != c {
			t.Errorf("%s written out as %q, %v; want %q", n, b, err, c)
		}
	}
	if again, err := moduleSource(root, "kept"); err != nil || again != dir {
		t.Errorf("second write-out: %q, %v; want %q", again, err, dir)
	}
	if _, err := moduleSource(root, "absent"); err == nil || !strings.Contains(err.Error(), "absent") {
		t.Errorf("a missing module: %v, want an error naming it", err)
	}
}
