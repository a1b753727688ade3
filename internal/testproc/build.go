package testproc

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Binaries are cached per process once found or built.
var (
	binariesMu sync.Mutex
	binaries   = map[string]string{}
)

// Binary returns the path of the command in the main package pkg (a
// directory relative to the module root, such as
// "internal/etcdtest/etcdserver"), built from this module once into
// <user cache dir>/identityd-testbin as <name>-<key>, keyed by the module's go.mod and go.sum,
// the package's Go files and the Go toolchain, so repeated and parallel test
// runs share one build: a file lock keeps concurrent test binaries from
// building at the same time (one build of such a server takes all cores). When the environment variable env is set,
// its value is the binary, an escape hatch for machines without a Go
// toolchain at test time.
func Binary(name, pkg, env string) (string, error) {
	binariesMu.Lock()
	defer binariesMu.Unlock()
	if p, ok := binaries[pkg]; ok {
		return p, nil
	}
	if p := os.Getenv(env); p != "" {
		binaries[pkg] = p
		return p, nil
	}
	p, err := build(name, pkg)
	if err != nil {
		return "", err
	}
	binaries[pkg] = p
	return p, nil
}

func build(name, pkg string) (string, error) {
	modFile, err := goEnv("GOMOD")
	if err != nil {
		return "", err
	}
	if modFile == "" || modFile == os.DevNull {
		return "", fmt.Errorf("testproc: not inside a Go module, cannot build %s", name)
	}
	root := filepath.Dir(modFile)
	key, err := sourceKey(root, pkg)
	if err != nil {
		return "", err
	}

	cacheRoot, err := os.UserCacheDir()
	if err != nil {
		cacheRoot = os.TempDir()
	}
	dir := filepath.Join(cacheRoot, "identityd-testbin")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("testproc: creating cache dir: %w", err)
	}
	bin := filepath.Join(dir, name+"-"+key)
	if isExecutable(bin) {
		return bin, nil
	}

	lock, err := os.OpenFile(filepath.Join(dir, "build.lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return "", fmt.Errorf("testproc: opening build lock: %w", err)
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return "", fmt.Errorf("testproc: taking build lock: %w", err)
	}
	defer syscall.Flock(int(lock.Fd()), syscall.LOCK_UN)

	// Another test binary may have built it while we waited for the lock.
	if isExecutable(bin) {
		return bin, nil
	}
	tmp := fmt.Sprintf("%s.tmp%d", bin, os.Getpid())
	cmd := exec.Command("go", "build", "-o", tmp, "./"+pkg)
	cmd.Dir = root
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	start := time.Now()
	if err := cmd.Run(); err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("testproc: building %s: %w\n%s", name, err, out.String())
	}
	// Rename is atomic, so other processes never see a partial binary.
	if err := os.Rename(tmp, bin); err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("testproc: installing %s: %w", name, err)
	}
	fmt.Fprintf(os.Stderr, "testproc: built %s in %s: %s\n", name, time.Since(start).Round(time.Second), bin)
	return bin, nil
}

// sourceKey hashes what the binary is built from: the module's
// dependencies, the package's own files and the toolchain.
func sourceKey(root, pkg string) (string, error) {
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
	fmt.Fprintf(h, "%s %s/%s", runtime.Version(), runtime.GOOS, runtime.GOARCH)
	return hex.EncodeToString(h.Sum(nil))[:16], nil
}

func goEnv(name string) (string, error) {
	out, err := exec.Command("go", "env", name).Output()
	if err != nil {
		return "", fmt.Errorf("testproc: go env %s: %w", name, err)
	}
	return strings.TrimSpace(string(out)), nil
}

func isExecutable(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0
}
