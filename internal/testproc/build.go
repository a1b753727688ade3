package testproc

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Binaries are cached per process once found or built.
var (
	binariesMu sync.Mutex
	binaries   = map[string]string{}
)

// Binary returns the path of the command in the main package pkg (a
// directory relative to the module root, such as
// "internal/etcdtest/etcdserver"), built from this module (found by
// moduleDir, also from another module's tests) once into
// <user cache dir>/identityd-testbin as <name>-<key>, keyed by the module's go.mod and go.sum,
// the package's Go files and the Go toolchain, so repeated and parallel test
// runs share one build: a file lock keeps concurrent test binaries from
// building at the same time (one build of such a server takes all cores). When the environment variable env is set,
// its value is the binary, an escape hatch for machines without a Go
// toolchain at test time. buildFlags go to go build after buildMode's and
// are part of the key.
//
// A build that must be done before deadline (the test's, see Deadline;
// zero for none) is stopped, its go command and compilers with it, when
// it would leave the test less than DeadlineReserve, and Binary returns
// ErrBuildTooLong; what it compiled stays in the build cache. A fresh
// machine's first build of the API server takes minutes: the error says
// to build first (PrebuildCommand), instead of a panic at go test's
// -timeout with the go command left running.
func Binary(deadline time.Time, name, pkg, env string, buildFlags ...string) (string, error) {
	return cachedBinary(deadline, name, "", pkg, env, buildFlags)
}

// ModuleBinary is Binary for the main package of a module of its own: a
// command whose dependencies must not reach this module's go.mod. Its
// files are kept in the directory mod of this module's source (relative
// to its root, such as "internal/k8stest/kubeapiserver") under names the
// go command does not take for a nested module (see ModuleSource), so
// that they ship in this module's zip and a module cache holds them too.
// The build runs in the module ModuleSource writes out.
func ModuleBinary(deadline time.Time, name, mod, env string, buildFlags ...string) (string, error) {
	return cachedBinary(deadline, name, mod, ".", env, buildFlags)
}

// cachedBinary is Binary of the package pkg of the module in the
// directory mod ("" for this module).
func cachedBinary(deadline time.Time, name, mod, pkg, env string, buildFlags []string) (string, error) {
	binariesMu.Lock()
	defer binariesMu.Unlock()
	id := filepath.Join(mod, pkg)
	if p, ok := binaries[id]; ok {
		return p, nil
	}
	if p := os.Getenv(env); p != "" {
		binaries[id] = p
		return p, nil
	}
	p, err := build(deadline, name, mod, pkg, env, buildFlags)
	if err != nil {
		return "", err
	}
	binaries[id] = p
	return p, nil
}

func build(deadline time.Time, name, mod, pkg, env string, buildFlags []string) (string, error) {
	root, err := moduleDir()
	if err != nil {
		return "", fmt.Errorf("testproc: cannot build %s: %w", name, err)
	}
	if mod != "" {
		if root, err = moduleSource(root, mod); err != nil {
			return "", fmt.Errorf("testproc: cannot build %s (or set %s to a binary): %w", name, env, err)
		}
	}
	key, err := sourceKey(root, pkg, buildFlags)
	if err != nil {
		return "", err
	}

	dir, err := cacheDir()
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, name+"-"+key)
	if isExecutable(bin) {
		return bin, nil
	}
	stopBy := time.Time{}
	if !deadline.IsZero() {
		stopBy = deadline.Add(-DeadlineReserve)
		if time.Until(stopBy) <= 0 {
			return "", buildTooLong(name, 0)
		}
	}
	err = withBuildLockBy(stopBy, name, func() error {
		// Another test binary may have built it while we waited for the lock.
		if isExecutable(bin) {
			return nil
		}
		return buildInto(stopBy, bin, name, root, pkg, buildFlags)
	})
	if err != nil {
		return "", err
	}
	return bin, nil
}

// cacheDir is where Binary keeps what it built, and the build lock.
func cacheDir() (string, error) {
	cacheRoot, err := os.UserCacheDir()
	if err != nil {
		cacheRoot = os.TempDir()
	}
	dir := filepath.Join(cacheRoot, "identityd-testbin")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("testproc: creating cache dir: %w", err)
	}
	return dir, nil
}

// WithBuildLock runs fn holding a lock that every test binary of this user
// takes for its go commands in buildMode (Binary, BuildAgent and any other
// build or test in InImageMode). Two go commands compiling the same
// packages at once both compile them: the build cache only helps the one
// that starts after the other has finished. Test binaries running in
// parallel on a fresh machine would otherwise each compile the agent's and
// the servers' dependencies, several times the work of one build.
func WithBuildLock(fn func() error) error {
	return withBuildLockBy(time.Time{}, "", fn)
}

// withBuildLockBy is WithBuildLock that gives up waiting for the lock at
// stopBy (unless zero), with ErrBuildTooLong for the binary name.
func withBuildLockBy(stopBy time.Time, name string, fn func() error) error {
	dir, err := cacheDir()
	if err != nil {
		return err
	}
	lock, err := os.OpenFile(filepath.Join(dir, "build.lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return fmt.Errorf("testproc: opening build lock: %w", err)
	}
	defer lock.Close()
	start := time.Now()
	for {
		how := syscall.LOCK_EX
		if !stopBy.IsZero() {
			how |= syscall.LOCK_NB
		}
		err := syscall.Flock(int(lock.Fd()), how)
		if err == nil {
			break
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			return fmt.Errorf("testproc: taking build lock: %w", err)
		}
		if time.Now().After(stopBy) {
			return buildTooLong(name, time.Since(start))
		}
		time.Sleep(100 * time.Millisecond)
	}
	defer syscall.Flock(int(lock.Fd()), syscall.LOCK_UN)
	return fn()
}

// DeadlineReserve is the time a build leaves its test before the test's
// deadline, to start the servers and run.
const DeadlineReserve = 2 * time.Minute

// ErrBuildTooLong: a test server's build would have run past its test's
// deadline, less DeadlineReserve, and was stopped.
var ErrBuildTooLong = errors.New("build stopped before the test's deadline")

// PrebuildCommand builds the test servers into the cache ahead of the
// tests, with no deadline.
const PrebuildCommand = "go run " + ModulePath + "/testenv/prebuild"

func buildTooLong(name string, after time.Duration) error {
	return fmt.Errorf("testproc: %w: the test server %s is not built yet (its build stopped after %s; what it compiled stays in the build cache); run `%s` once before the tests, or give go test a longer -timeout",
		ErrBuildTooLong, name, after.Round(time.Second), PrebuildCommand)
}

// Deadline returns tb's deadline (go test's -timeout), or zero when it has
// none or tb does not say.
func Deadline(tb testing.TB) time.Time {
	if d, ok := tb.(interface{ Deadline() (time.Time, bool) }); ok {
		if t, ok := d.Deadline(); ok {
			return t
		}
	}
	return time.Time{}
}

// CombinedOutputLocked runs cmd under WithBuildLock and returns its
// combined output: for a go command in buildMode.
func CombinedOutputLocked(cmd *exec.Cmd) (out []byte, err error) {
	err = WithBuildLock(func() error {
		out, err = cmd.CombinedOutput()
		return err
	})
	return out, err
}

// buildInto builds the command in pkg into bin, stopping the build at
// stopBy (unless zero).
func buildInto(stopBy time.Time, bin, name, root, pkg string, buildFlags []string) error {
	tmp := fmt.Sprintf("%s.tmp%d", bin, os.Getpid())
	cmd := goBuild(tmp, "./"+pkg, buildFlags...)
	cmd.Dir = root
	// This module's go.mod alone decides the versions, also under an
	// importer's workspace.
	cmd.Env = append(cmd.Env, "GOWORK=off")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	start := time.Now()
	if err := runBy(cmd, stopBy); err != nil {
		os.Remove(tmp)
		if errors.Is(err, ErrBuildTooLong) {
			return buildTooLong(name, time.Since(start))
		}
		return fmt.Errorf("testproc: building %s: %w\n%s", name, err, out.String())
	}
	// Rename is atomic, so other processes never see a partial binary.
	if err := os.Rename(tmp, bin); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("testproc: installing %s: %w", name, err)
	}
	fmt.Fprintf(os.Stderr, "testproc: built %s in %s: %s\n", name, time.Since(start).Round(time.Second), bin)
	return nil
}

// runBy runs cmd, which must not be started, and stops it with the
// processes it started at stopBy (unless zero), returning
// ErrBuildTooLong: the go command's compilers are its children, in its
// process group, and would go on without it. The kernel stops the go
// command if this process dies first (a test killed at its -timeout).
func runBy(cmd *exec.Cmd, stopBy time.Time) error {
	if stopBy.IsZero() {
		return cmd.Run()
	}
	SetDeathSignal(cmd)
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Setpgid = true
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	timer := time.NewTimer(time.Until(stopBy))
	defer timer.Stop()
	select {
	case err := <-done:
		return err
	case <-timer.C:
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-done
		return ErrBuildTooLong
	}
}

// sourceKey hashes what the binary is built from: the module's
// dependencies, the package's own files, the toolchain and the flags.
func sourceKey(root, pkg string, buildFlags []string) (string, error) {
	h := sha256.New()
	for _, f := range []string{"go.mod", "go.sum"} {
		b, err := os.ReadFile(filepath.Join(root, f))
		if err != nil && !(f == "go.sum" && errors.Is(err, os.ErrNotExist)) {
			return "", fmt.Errorf("testproc: reading %s: %w", f, err)
		}
		h.Write(b)
	}
	files, err := filepath.Glob(filepath.Join(root, pkg, "*.go"))
	if err != nil || len(files) == 0 {
		return "", fmt.Errorf("testproc: no Go files in %s", pkg)
	}
	slices.Sort(files)
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return "", fmt.Errorf("testproc: reading source: %w", err)
		}
		fmt.Fprintf(h, "%s %d\n", filepath.Base(f), len(b))
		h.Write(b)
	}
	fmt.Fprintf(h, "%s %s/%s %s %q", runtime.Version(), runtime.GOOS, runtime.GOARCH, buildMode, buildFlags)
	return hex.EncodeToString(h.Sum(nil))[:16], nil
}

// ModulePath is the path of the module whose commands Binary builds.
const ModulePath = "github.com/identityd/identityd"

// moduleDir returns the directory of this module's source as the go
// command in the working directory sees it: the main module's when the
// test is one of this module's, or the required (or replaced) module's
// when the test belongs to a module that imports the public test-support
// package. The commands are built there, with this module's own go.mod and
// go.sum, so that an importer's tests run the same servers as this
// module's and share their cached binaries.
func moduleDir() (string, error) {
	cmd := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", ModulePath)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("go list -m %s (run the test inside a module that requires it): %w\n%s", ModulePath, err, stderr.String())
	}
	dir := strings.TrimSpace(string(out))
	if dir == "" {
		return "", fmt.Errorf("go list -m %s: the module's source is not in the module cache (go mod download %s)", ModulePath, ModulePath)
	}
	return dir, nil
}

func isExecutable(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0
}

// AgentPackage is the import path of the identityd command.
const AgentPackage = "github.com/identityd/identityd/cmd/identityd"

// buildMode is how the binaries the tests run as processes are built: as
// the image's (the Dockerfile's CGO_ENABLED=0 and -trimpath). Every binary
// the tests build without -race (the test servers, the agents, the image's
// binary) is built in this one mode, so that a fresh machine compiles the
// dependencies in two modes in all, this one and -race, instead of once
// more per set of flags.
const buildMode = "CGO_ENABLED=0 -trimpath"

// InImageMode returns the go command `go verb -trimpath args...` with
// CGO_ENABLED=0 added to this process's environment: go build or go test
// in buildMode, for what a test builds that is not race-built. Run it under
// WithBuildLock (CombinedOutputLocked).
func InImageMode(verb string, args ...string) *exec.Cmd {
	cmd := exec.Command("go", append([]string{verb, "-trimpath"}, args...)...)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	return cmd
}

// goBuild is `go build flags... -o out pkg` in buildMode.
func goBuild(out, pkg string, flags ...string) *exec.Cmd {
	return InImageMode("build", append(slices.Clone(flags), "-o", out, pkg)...)
}

// BuildAgent builds the identityd binary from this module into dir, as the
// image's is built (no race detector: the agents' speed sets the length of
// the tests that run them as processes), and returns its path.
//
// The binary is built into a directory of the user's cache kept per
// checkout (sharedAgentPath) and copied into dir. The go command leaves a
// binary that is up to date with the sources as it is, so the test
// binaries of one `make test` link the agent once between them (the
// build cache spares them the compile, not the link) and each runs its
// own copy, which no later build replaces.
func BuildAgent(dir string) (string, error) {
	shared, err := sharedAgentPath()
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "identityd")
	err = WithBuildLock(func() error {
		if err := os.MkdirAll(filepath.Dir(shared), 0o755); err != nil {
			return fmt.Errorf("testproc: %w", err)
		}
		if out, err := goBuild(shared, AgentPackage).CombinedOutput(); err != nil {
			return fmt.Errorf("testproc: go build %s: %w\n%s", AgentPackage, err, out)
		}
		now := time.Now()
		os.Chtimes(shared, now, now) // in use: pruneSharedAgents keeps it
		// Under the lock, so that no other checkout's build is under way
		// in a directory this deletes.
		pruneSharedAgents(filepath.Dir(filepath.Dir(shared)), filepath.Dir(shared))
		return copyExecutable(shared, bin)
	})
	if err != nil {
		return "", err
	}
	return bin, nil
}

// sharedAgentPath is where BuildAgent builds the agent of this checkout:
// under the user's cache, in a directory named after the module's
// directory, so that checkouts with other sources never replace each
// other's binary.
func sharedAgentPath() (string, error) {
	root, err := moduleDir()
	if err != nil {
		return "", err
	}
	cache, err := cacheDir()
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256([]byte(root))
	return filepath.Join(cache, "agents", hex.EncodeToString(sum[:8]), "identityd"), nil
}

// sharedAgentsKept is how long an agent of a checkout no test used stays
// in the cache.
const sharedAgentsKept = 24 * time.Hour

// pruneSharedAgents deletes the agents of other checkouts under dir that
// no build used for sharedAgentsKept (a clone per CI run leaves one each).
func pruneSharedAgents(dir, keep string) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range entries {
		sub := filepath.Join(dir, e.Name())
		if sub == keep {
			continue
		}
		if fi, err := os.Stat(filepath.Join(sub, "identityd")); err == nil && time.Since(fi.ModTime()) < sharedAgentsKept {
			continue
		}
		os.RemoveAll(sub)
	}
}

// copyExecutable copies the executable src to dst, a new file (a process
// running an earlier dst keeps its own).
func copyExecutable(src, dst string) error {
	if err := os.Remove(dst); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("testproc: %w", err)
	}
	in, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("testproc: %w", err)
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o755)
	if err != nil {
		return fmt.Errorf("testproc: %w", err)
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		os.Remove(dst)
		return fmt.Errorf("testproc: copying the agent: %w", err)
	}
	if err := out.Close(); err != nil {
		os.Remove(dst)
		return fmt.Errorf("testproc: copying the agent: %w", err)
	}
	return nil
}

// OnceBuild is a binary a test binary builds once, into a temporary
// directory of its own, for the tests that run it by path: Start begins the
// build in the background (from TestMain, so that it links while the first
// tests run), Path waits for it, and Remove, after m.Run, waits for a build
// still running and deletes the directory.
type OnceBuild struct {
	// Build builds the binary into dir and returns its path.
	Build func(dir string) (string, error)

	once sync.Once
	dir  string
	bin  string
	err  error
}

func (b *OnceBuild) build() {
	if b.dir, b.err = os.MkdirTemp("", "identityd-test-bin"); b.err != nil {
		return
	}
	b.bin, b.err = b.Build(b.dir)
}

// Start begins the build in the background.
func (b *OnceBuild) Start() { go b.once.Do(b.build) }

// Path returns the binary's path once built, failing tb if the build
// failed.
func (b *OnceBuild) Path(tb testing.TB) string {
	tb.Helper()
	b.once.Do(b.build)
	if b.err != nil {
		tb.Fatal(b.err)
	}
	return b.bin
}

// Remove waits for a build still running and deletes its directory.
func (b *OnceBuild) Remove() {
	b.once.Do(func() {})
	if b.dir != "" {
		os.RemoveAll(b.dir)
	}
}

// moduleFileSuffix marks the files of a module kept inside this one: with
// it, no go.mod makes their directory a nested module, which the go
// command would leave out of this module's zip and its packages' lists.
const moduleFileSuffix = ".in"

// ModuleSource writes out the module kept in the directory mod of this
// module's source (its files named with the suffix ".in": go.mod.in,
// go.sum.in, main.go.in) as a module under the user's cache, once per
// content, and returns its directory. The go command builds and vets it
// there with its own go.mod and go.sum. To change the module (a new
// version of a dependency), write it out, run the go command in that
// directory, and copy go.mod and go.sum back as go.mod.in and go.sum.in.
func ModuleSource(mod string) (string, error) {
	root, err := moduleDir()
	if err != nil {
		return "", err
	}
	return moduleSource(root, mod)
}

func moduleSource(root, mod string) (string, error) {
	src := filepath.Join(root, mod)
	names, err := filepath.Glob(filepath.Join(src, "*"+moduleFileSuffix))
	if err != nil || len(names) == 0 {
		return "", fmt.Errorf("no module files (*%s) in %s of %s's source", moduleFileSuffix, mod, ModulePath)
	}
	slices.Sort(names)
	files := map[string][]byte{}
	h := sha256.New()
	for _, n := range names {
		b, err := os.ReadFile(n)
		if err != nil {
			return "", fmt.Errorf("reading the module of %s: %w", mod, err)
		}
		base := strings.TrimSuffix(filepath.Base(n), moduleFileSuffix)
		files[base] = b
		fmt.Fprintf(h, "%s %d\n", base, len(b))
		h.Write(b)
	}
	if _, ok := files["go.mod"]; !ok {
		return "", fmt.Errorf("the module of %s has no go.mod%s", mod, moduleFileSuffix)
	}
	cache, err := cacheDir()
	if err != nil {
		return "", err
	}
	dir := filepath.Join(cache, filepath.Base(mod)+"-module-"+hex.EncodeToString(h.Sum(nil))[:16])
	if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
		return dir, nil
	}
	// Written aside and renamed, so that a directory under the final name
	// is always whole, also with other test binaries writing it at once.
	tmp, err := os.MkdirTemp(cache, filepath.Base(mod)+"-module-tmp")
	if err != nil {
		return "", fmt.Errorf("testproc: writing the module of %s: %w", mod, err)
	}
	defer os.RemoveAll(tmp)
	for base, b := range files {
		if err := os.WriteFile(filepath.Join(tmp, base), b, 0o644); err != nil {
			return "", fmt.Errorf("testproc: writing the module of %s: %w", mod, err)
		}
	}
	if err := os.Chmod(tmp, 0o755); err != nil {
		return "", fmt.Errorf("testproc: writing the module of %s: %w", mod, err)
	}
	if err := os.Rename(tmp, dir); err != nil {
		if _, serr := os.Stat(filepath.Join(dir, "go.mod")); serr == nil {
			return dir, nil // written by another process meanwhile
		}
		return "", fmt.Errorf("testproc: writing the module of %s: %w", mod, err)
	}
	return dir, nil
}
