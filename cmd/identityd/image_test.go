package main

import (
	"archive/tar"
	"bytes"
	"crypto/rand"
	"debug/elf"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"

	"github.com/identityd/identityd/internal/k8stest"
)

const dockerfile = "../../Dockerfile"

// dockerfileBuild reads what the Dockerfile's builder stage sets and runs:
// its ARG defaults and ENV values (${VAR} substituted as the builder does)
// and the exec-form RUN of `go build`.
func dockerfileBuild() (env map[string]string, build []string, err error) {
	data, err := os.ReadFile(dockerfile)
	if err != nil {
		return nil, nil, err
	}
	vars := map[string]string{}
	env = map[string]string{}
	subst := func(s string) string {
		return regexp.MustCompile(`\$\{(\w+)\}`).ReplaceAllStringFunc(s, func(m string) string { return vars[m[2:len(m)-1]] })
	}
	pair := regexp.MustCompile(`(\w+)=("[^"]*"|\S*)`)
	for l := range strings.Lines(string(data)) {
		instr, rest, _ := strings.Cut(strings.TrimSpace(l), " ")
		switch instr {
		case "FROM":
			if strings.HasPrefix(rest, "scratch") {
				if build == nil {
					return nil, nil, fmt.Errorf("%s: the builder stage runs no exec-form `go build`", dockerfile)
				}
				return env, build, nil // the final stage builds nothing
			}
		case "ARG":
			name, def, _ := strings.Cut(rest, "=")
			vars[name] = def
		case "ENV":
			for _, m := range pair.FindAllStringSubmatch(rest, -1) {
				v := subst(strings.Trim(m[2], `"`))
				vars[m[1]], env[m[1]] = v, v
			}
		case "RUN":
			var argv []string
			if err := json.Unmarshal([]byte(rest), &argv); err != nil {
				return nil, nil, fmt.Errorf("%s: RUN %s: want the exec form (the builder needs no shell): %w", dockerfile, rest, err)
			}
			if len(argv) > 1 && argv[0] == "go" && argv[1] == "build" {
				build = argv
			}
		}
	}
	return nil, nil, fmt.Errorf("%s: no FROM scratch stage", dockerfile)
}

// dockerfileBuildCmd is the Dockerfile's `go build` as a command on this
// host, writing the binary to out.
func dockerfileBuildCmd(out string) (*exec.Cmd, error) {
	env, build, err := dockerfileBuild()
	if err != nil {
		return nil, err
	}
	argv := slices.Clone(build)
	i := slices.Index(argv, "-o")
	if i < 0 || i+1 >= len(argv) {
		return nil, fmt.Errorf("%s: %v names no output", dockerfile, build)
	}
	argv[i+1] = out
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Dir = "../.."
	cmd.Env = os.Environ()
	for k, v := range env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	return cmd, nil
}

// checkStatic fails unless bin is a static executable: no interpreter, no
// shared library, so that it runs on the image's empty base.
func checkStatic(t *testing.T, bin string) {
	t.Helper()
	f, err := elf.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Errorf("%s has an ELF interpreter: it is dynamically linked and cannot run on an empty base", bin)
		}
	}
	if libs, _ := f.ImportedLibraries(); len(libs) > 0 {
		t.Errorf("%s needs shared libraries %v", bin, libs)
	}
}

// TestImage builds the image of the Dockerfile and runs it as
// deploy/base's DaemonSet runs it: with its args and variables, a read-only
// root, every capability dropped but the ones the DaemonSet adds, the state
// directory and the host's bpffs mounted, on the host network, against a
// real API server. The agent gets ready, creates and pins the BPF map (when
// the host has a bpffs and the test runs as root), allocates through
// `identityd shell` in the container, and exits 0 on SIGTERM with the
// checkpoint written. The binary in the image must be static.
//
// The image is built with podman. Without podman, the test builds the
// binary the image would contain, with the Dockerfile's settings, on the
// host, and checks that it is static and runs. These machines reach no
// image registry, so the builder stage runs on an image made here from the
// host's Go toolchain and module cache (mounted, offline); `make image`
// uses the Dockerfile's builder image.
func TestImage(t *testing.T) {
	parallelProcess(t)
	if testing.Short() {
		t.Skip("builds the agent")
	}
	podman, err := exec.LookPath("podman")
	if err != nil {
		t.Log("podman is not installed: the image is not built; testing the binary it would contain instead")
		testImageBinary(t)
		return
	}
	p := newPodman(t, podman)
	tag := "localhost/identityd-test:" + randomHex(6)
	p.buildImage(tag)
	t.Cleanup(func() { p.run("rmi", "-f", tag) })

	bin := filepath.Join(t.TempDir(), "identityd")
	id := strings.TrimSpace(p.run("create", tag))
	p.run("cp", id+":/usr/local/bin/identityd", bin)
	p.run("rm", id)
	checkStatic(t, bin)

	ds := findObject[*appsv1.DaemonSet](t, buildDeploy(t, "base"), "DaemonSet")[0]
	runImageAsDaemonSet(t, p, tag, ds)
}

// testImageBinary checks the binary the image would contain: agentBinary
// builds it with the Dockerfile's settings.
func testImageBinary(t *testing.T) {
	env, _, err := dockerfileBuild()
	if err != nil {
		t.Fatal(err)
	}
	if env["CGO_ENABLED"] != "0" {
		t.Errorf("Dockerfile: CGO_ENABLED=%q, want 0 (a static binary)", env["CGO_ENABLED"])
	}
	bin := agentBinary(t)
	checkStatic(t, bin)
	out, err := exec.Command(bin, "--help").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--identity-allocation-mode") {
		t.Fatalf("%s --help: %v\n%s", bin, err, out)
	}
	if out, err := exec.Command(bin, "version").Output(); err != nil || !strings.HasPrefix(string(out), "identityd dev") {
		t.Errorf("%s version: %v: %q, want the Dockerfile's VERSION", bin, err, out)
	}
	runWithDaemonSetCapabilities(t, bin)
}

// runWithDaemonSetCapabilities runs bin as root with no capability but the
// ones deploy/base's DaemonSet adds (setpriv's bounding set, as a
// container runtime sets it) and --ipcache-map=bpf on the host's bpffs:
// the agent must get ready with the map created and pinned. It needs root,
// a bpffs at /sys/fs/bpf and setpriv, and says so when one is missing.
func runWithDaemonSetCapabilities(t *testing.T, bin string) {
	t.Helper()
	setpriv, err := exec.LookPath("setpriv")
	if err != nil || os.Geteuid() != 0 || !isBPFFS("/sys/fs/bpf") {
		t.Log("the DaemonSet's capabilities are not tried: that needs root, a bpffs at /sys/fs/bpf and setpriv")
		return
	}
	ds := findObject[*appsv1.DaemonSet](t, buildDeploy(t, "base"), "DaemonSet")[0]
	caps := "-all"
	for _, c := range ds.Spec.Template.Spec.Containers[0].SecurityContext.Capabilities.Add {
		caps += ",+" + strings.ToLower(string(c))
	}
	pinDir := "/sys/fs/bpf/identityd-test-" + randomHex(4)
	t.Cleanup(func() { os.RemoveAll(pinDir) })
	addr := "127.0.0.1:" + strconv.Itoa(freePort(t))
	var log bytes.Buffer
	cmd := exec.Command(setpriv, "--bounding-set", caps, "--inh-caps", "-all", "--no-new-privs", "--",
		bin, "--state-dir", filepath.Join(t.TempDir(), "state"), "--ipcache-map=bpf", "--ipcache-map-pin-path", pinDir+"/ipcache",
		"--prometheus-serve-addr", addr)
	cmd.Stdout, cmd.Stderr = &log, &log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	var waitErr error
	go func() { waitErr = cmd.Wait(); close(exited) }()
	defer func() {
		cmd.Process.Kill()
		<-exited
		if t.Failed() {
			t.Logf("the agent's log:\n%s", log.String())
		}
	}()
	waitReadyz(t, addr, 90*time.Second, func() bool {
		select {
		case <-exited:
			return true
		default:
			return false
		}
	})
	cmd.Process.Signal(os.Interrupt)
	<-exited
	if waitErr != nil {
		t.Errorf("the agent with capabilities %s exited %v", caps, waitErr)
	}
	if !strings.Contains(log.String(), "created and pinned BPF LPM trie "+pinDir+"/ipcache") {
		t.Errorf("the agent with capabilities %s did not create the pinned map", caps)
	}
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// podman runs podman with the flags this machine needs: runc when it is
// installed (crun refuses cgroup v1 hosts with a v2 hierarchy beside, as
// these machines have), and rlimits no higher than the test's own (podman
// would set its defaults, which a root without CAP_SYS_RESOURCE cannot).
type podman struct {
	t      *testing.T
	bin    string
	global []string
	limits []string
}

func newPodman(t *testing.T, bin string) *podman {
	p := &podman{t: t, bin: bin}
	if _, err := exec.LookPath("runc"); err == nil {
		p.global = []string{"--runtime", "runc"}
	}
	var nofile, nproc unix.Rlimit
	unix.Getrlimit(unix.RLIMIT_NOFILE, &nofile)
	unix.Getrlimit(unix.RLIMIT_NPROC, &nproc)
	n := min(nproc.Cur, 8192)
	p.limits = []string{"--ulimit", fmt.Sprintf("nofile=%d:%d", nofile.Cur, nofile.Cur), "--ulimit", fmt.Sprintf("nproc=%d:%d", n, n)}
	return p
}

func (p *podman) command(args ...string) *exec.Cmd {
	return exec.Command(p.bin, append(slices.Clone(p.global), args...)...)
}

func (p *podman) run(args ...string) string {
	p.t.Helper()
	out, err := p.command(args...).CombinedOutput()
	if err != nil {
		p.t.Fatalf("podman %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// buildImage builds the Dockerfile as tag, the builder stage on an image
// of the host's Go toolchain, offline.
func (p *podman) buildImage(tag string) {
	t := p.t
	t.Helper()
	goenv := func(name string) string {
		out, err := exec.Command("go", "env", name).Output()
		if err != nil {
			t.Fatalf("go env %s: %v", name, err)
		}
		return strings.TrimSpace(string(out))
	}
	goroot, modcache, gocache := goenv("GOROOT"), goenv("GOMODCACHE"), goenv("GOCACHE")
	// The builder runs offline (GOPROXY=off) on this module cache, and
	// the Dockerfile's `go mod download` wants every module go.mod names;
	// on a fresh machine the cache holds only those a build needed.
	download := exec.Command("go", "mod", "download")
	download.Dir = "../.."
	if out, err := download.CombinedOutput(); err != nil {
		t.Fatalf("go mod download: %v\n%s", err, out)
	}

	// The builder's base: directories the go command needs, its PATH and
	// module settings; the toolchain and the caches are mounted.
	var base bytes.Buffer
	tw := tar.NewWriter(&base)
	for _, d := range []struct {
		name string
		mode int64
	}{{"tmp/", 0o1777}, {"root/", 0o700}, {"go/", 0o755}} {
		tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d.name, Mode: d.mode, ModTime: time.Unix(0, 0)})
	}
	tw.Close()
	baseTar := filepath.Join(t.TempDir(), "go-base.tar")
	if err := os.WriteFile(baseTar, base.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	goImage := "localhost/identityd-test-go:" + randomHex(6)
	p.run("import", "--change", "ENV PATH=/usr/local/go/bin", "--change", "ENV HOME=/root", "--change", "ENV GOPATH=/go",
		"--change", "ENV GOPROXY=off", "--change", "ENV GOCACHE=/root/.cache/go-build", baseTar, goImage)
	t.Cleanup(func() { p.run("rmi", "-f", goImage) })

	start := time.Now()
	args := append([]string{"build", "--layers=false", "--network", "none", "--build-arg", "GO_IMAGE=" + goImage,
		"-v", goroot + ":/usr/local/go:ro", "-v", modcache + ":/go/pkg/mod", "-v", gocache + ":/root/.cache/go-build",
		"-t", tag, "-f", dockerfile}, p.limits...)
	p.run(append(args, "../..")...)
	t.Logf("built image %s in %s", tag, time.Since(start).Round(time.Second))
}

// runImageAsDaemonSet runs the image as ds's container, in crd mode
// against a test API server, and checks it as TestImage says.
func runImageAsDaemonSet(t *testing.T, p *podman, tag string, ds *appsv1.DaemonSet) {
	t.Helper()
	c := ds.Spec.Template.Spec.Containers[0]
	sc := c.SecurityContext
	if sc == nil || sc.RunAsUser == nil || sc.RunAsGroup == nil || sc.Capabilities == nil || ds.Spec.Template.Spec.TerminationGracePeriodSeconds == nil {
		t.Fatal("deploy/base's DaemonSet sets no user, group, capabilities or grace period (TestDeployDaemonSet)")
	}
	srv := k8stest.Start(t)
	state := t.TempDir()
	// As the kubelet creates a missing hostPath directory: the agent
	// tightens it.
	if err := os.Chmod(state, 0o755); err != nil {
		t.Fatal(err)
	}
	kube := t.TempDir()
	data, err := os.ReadFile(srv.Kubeconfig())
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(kube, "kubeconfig"), data, 0o600); err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	addr := "127.0.0.1:" + strconv.Itoa(port)

	// The DaemonSet's args, but for what must not clash with other agents
	// on this host: the probe port, and the pin (on the host's bpffs when
	// there is one and the test may create maps there).
	pinDir := "/sys/fs/bpf/identityd-test-" + randomHex(4)
	useBPF := os.Geteuid() == 0 && isBPFFS("/sys/fs/bpf")
	var args []string
	for _, a := range c.Args {
		name, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		switch name {
		case "prometheus-serve-addr":
			a = "--prometheus-serve-addr=" + addr
		case "ipcache-map-pin-path":
			a = "--ipcache-map-pin-path=" + pinDir + "/ipcache"
		case "ipcache-map":
			if !useBPF {
				t.Log("no bpffs at /sys/fs/bpf, or not root: the image runs with --ipcache-map=file")
				a = "--ipcache-map=file"
			}
		}
		args = append(args, a)
	}
	args = append(args, "--k8s-kubeconfig-path=/etc/identityd/kubeconfig", "--identity-restore-grace-period=1s")

	run := []string{"run", "-d", "--network", "host", "--read-only", "--security-opt", "no-new-privileges",
		"--user", fmt.Sprintf("%d:%d", *c.SecurityContext.RunAsUser, *c.SecurityContext.RunAsGroup),
		"--stop-timeout", strconv.FormatInt(*ds.Spec.Template.Spec.TerminationGracePeriodSeconds, 10),
		"-v", state + ":/var/run/identityd", "-v", kube + ":/etc/identityd:ro",
		"-e", "IDENTITYD_NODE_NAME=node-image"}
	run = append(run, p.limits...)
	if sp := sc.SeccompProfile; sp != nil && sp.Type == corev1.SeccompProfileTypeUnconfined {
		run = append(run, "--security-opt", "seccomp=unconfined")
	} else if sp != nil && sp.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Fatalf("the container's seccomp profile %s has no podman equivalent here", sp.Type)
	}
	for _, cp := range c.SecurityContext.Capabilities.Drop {
		run = append(run, "--cap-drop", string(cp))
	}
	for _, cp := range c.SecurityContext.Capabilities.Add {
		run = append(run, "--cap-add", string(cp))
	}
	if useBPF {
		// The pin's directory alone, created as the kubelet creates the
		// DaemonSet's hostPath (DirectoryOrCreate).
		t.Cleanup(func() { os.RemoveAll(pinDir) })
		if err := os.MkdirAll(pinDir, 0o755); err != nil {
			t.Fatal(err)
		}
		run = append(run, "-v", pinDir+":"+pinDir)
	}
	for _, e := range c.Env {
		if e.ValueFrom != nil && e.ValueFrom.ResourceFieldRef != nil {
			run = append(run, "-e", e.Name+"="+strconv.FormatInt(c.Resources.Limits.Memory().Value(), 10))
		}
	}
	name := "identityd-test-" + randomHex(4)
	run = append(run, "--name", name, tag)
	p.run(append(run, args...)...)
	t.Cleanup(func() {
		if t.Failed() {
			out, _ := p.command("logs", name).CombinedOutput()
			t.Logf("the container's log:\n%s", out)
		}
		p.command("rm", "-f", name).Run()
	})

	waitReadyz(t, addr, 90*time.Second, func() bool {
		return strings.TrimSpace(p.run("inspect", "-f", "{{.State.Running}}", name)) != "true"
	})
	out := p.run("exec", name, "identityd", "shell", "--", "identity/allocate", "cidr:10.1.0.0/16", "reserved:world")
	if !strings.Contains(out, "16777") {
		t.Errorf("identity/allocate in the container: %s", out)
	}
	logs := p.run("logs", name)
	if useBPF && !strings.Contains(logs, "created and pinned BPF LPM trie "+pinDir+"/ipcache") {
		t.Errorf("the agent in the image did not create the pinned BPF map with the DaemonSet's capabilities %v:\n%s", c.SecurityContext.Capabilities.Add, logs)
	}

	// SIGTERM, as the kubelet stops the pod: a clean exit with the
	// checkpoint written.
	p.run("stop", "-t", strconv.FormatInt(*ds.Spec.Template.Spec.TerminationGracePeriodSeconds, 10), name)
	code := strings.TrimSpace(p.run("inspect", "-f", "{{.State.ExitCode}}", name))
	if code != "0" {
		t.Errorf("the container exited %s after SIGTERM", code)
	}
	if _, err := os.Stat(filepath.Join(state, "local_allocator_state.json")); err != nil {
		t.Errorf("no checkpoint in the state directory after the stop: %v", err)
	}
	if fi, err := os.Stat(state); err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("the state directory is %v, want 0700 (%v)", fi.Mode().Perm(), err)
	}
}

func isBPFFS(dir string) bool {
	var st unix.Statfs_t
	return unix.Statfs(dir, &st) == nil && st.Type == unix.BPF_FS_MAGIC
}

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// waitReadyz waits until the agent at addr answers /readyz with 200, and
// fails the test after within or once exited says the agent is gone.
func waitReadyz(t *testing.T, addr string, within time.Duration, exited func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		if exited() {
			t.Fatalf("the agent exited before it was ready at %s/readyz", addr)
		}
		resp, err := http.Get("http://" + addr + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
			err = fmt.Errorf("%s", resp.Status)
		}
		if time.Now().After(deadline) {
			t.Fatalf("not ready at %s/readyz within %v: %v", addr, within, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}
