package etcdtest

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
	"strings"
	"sync"
	"syscall"
	"time"
)

// The binary is cached per process once found or built.
var (
	binaryMu   sync.Mutex
	binaryPath string
)

// Binary returns the path of the etcd server binary built from this module's
// go.etcd.io/etcd/server/v3 version. It is built once into
// <user cache dir>/identityd-etcdtest, keyed by the module's go.sum and the
// Go toolchain, so repeated and parallel test runs share one build: a file
// lock keeps concurrent test binaries from building it at the same time.
func Binary() (string, error) {
	binaryMu.Lock()
	defer binaryMu.Unlock()
	if binaryPath != "" {
		return binaryPath, nil
	}
	p, err := buildBinary()
	if err != nil {
		return "", err
	}
	binaryPath = p
	return p, nil
}

func buildBinary() (string, error) {
	if p := os.Getenv("IDENTITYD_ETCD_BINARY"); p != "" {
		// An escape hatch for machines without a Go toolchain at test time.
		return p, nil
	}
	modFile, err := goEnv("GOMOD")
	if err != nil {
		return "", err
	}
	if modFile == "" || modFile == os.DevNull {
		return "", errors.New("etcdtest: not inside a Go module, cannot build the etcd server")
	}
	root := filepath.Dir(modFile)
	sum, err := os.ReadFile(filepath.Join(root, "go.sum"))
	if err != nil {
		return "", fmt.Errorf("etcdtest: reading go.sum: %w", err)
	}
	mainSrc, err := os.ReadFile(filepath.Join(root, "internal", "etcdtest", "etcdserver", "main.go"))
	if err != nil {
		return "", fmt.Errorf("etcdtest: reading etcdserver source: %w", err)
	}
	h := sha256.New()
	h.Write(sum)
	h.Write(mainSrc)
	fmt.Fprintf(h, "%s %s/%s", runtime.Version(), runtime.GOOS, runtime.GOARCH)
	key := hex.EncodeToString(h.Sum(nil))[:16]

	cacheRoot, err := os.UserCacheDir()
	if err != nil {
		cacheRoot = os.TempDir()
	}
	dir := filepath.Join(cacheRoot, "identityd-etcdtest")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("etcdtest: creating cache dir: %w", err)
	}
	bin := filepath.Join(dir, "etcd-"+key)
	if isExecutable(bin) {
		return bin, nil
	}

	lock, err := os.OpenFile(filepath.Join(dir, "build.lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return "", fmt.Errorf("etcdtest: opening build lock: %w", err)
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return "", fmt.Errorf("etcdtest: taking build lock: %w", err)
	}
	defer syscall.Flock(int(lock.Fd()), syscall.LOCK_UN)

	// Another test binary may have built it while we waited for the lock.
	if isExecutable(bin) {
		return bin, nil
	}
	tmp := fmt.Sprintf("%s.tmp%d", bin, os.Getpid())
	cmd := exec.Command("go", "build", "-o", tmp, "./internal/etcdtest/etcdserver")
	cmd.Dir = root
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	start := time.Now()
	if err := cmd.Run(); err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("etcdtest: building etcd server: %w\n%s", err, out.String())
	}
	// Rename is atomic, so other processes never see a partial binary.
	if err := os.Rename(tmp, bin); err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("etcdtest: installing etcd server: %w", err)
	}
	fmt.Fprintf(os.Stderr, "etcdtest: built etcd server in %s: %s\n", time.Since(start).Round(time.Second), bin)
	return bin, nil
}

func goEnv(name string) (string, error) {
	out, err := exec.Command("go", "env", name).Output()
	if err != nil {
		return "", fmt.Errorf("etcdtest: go env %s: %w", name, err)
	}
	return strings.TrimSpace(string(out)), nil
}

func isExecutable(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0
}
