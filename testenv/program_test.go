package testenv_test

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"

	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/k8stest"
	"github.com/identityd/identityd/internal/testproc"
	"github.com/identityd/identityd/testenv"
)

// TestStartForAProgram: Start needs no testing.TB, puts the servers on
// the ports asked for, and Stop ends them: the ports are free again.
func TestStartForAProgram(t *testing.T) {
	t.Parallel()
	ports, err := testproc.FreePorts(3)
	if err != nil {
		t.Fatal(err)
	}
	s, err := testenv.Start(t.Context(), testenv.Config{
		EtcdClientPort: ports[0], EtcdPeerPort: ports[1],
		APIServer: true, APIServerPort: ports[2],
	})
	if err != nil {
		t.Fatal(err)
	}
	stopped := false
	defer func() {
		if !stopped {
			s.Stop()
		}
	}()
	if want := fmt.Sprintf("http://127.0.0.1:%d", ports[0]); len(s.Etcd.Endpoints()) != 1 || s.Etcd.Endpoints()[0] != want {
		t.Errorf("etcd endpoints %v, want [%s]", s.Etcd.Endpoints(), want)
	}
	if want := fmt.Sprintf("https://127.0.0.1:%d", ports[2]); s.APIServer.URL() != want {
		t.Errorf("API server at %s, want %s", s.APIServer.URL(), want)
	}
	cli, err := clientv3.New(s.Etcd.ClientConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	if _, err := cli.Put(t.Context(), "k", "v"); err != nil {
		t.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(s.APIServer.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := dyn.Resource(crdstore.CiliumIdentityResource).List(t.Context(), metav1.ListOptions{}); err != nil {
		t.Errorf("listing CiliumIdentities: %v", err)
	}

	s.Stop()
	stopped = true
	for _, p := range ports {
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
		if err != nil {
			t.Errorf("port %d still taken after Stop: %v", p, err)
			continue
		}
		l.Close()
	}
}

// TestStartOnATakenPort: a port in use fails Start with an error that
// names it, soon, and leaves nothing running on the other port.
func TestStartOnATakenPort(t *testing.T) {
	t.Parallel()
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	ports, err := testproc.FreePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	takenPort := taken.Addr().(*net.TCPAddr).Port
	began := time.Now()
	s, err := testenv.Start(t.Context(), testenv.Config{EtcdClientPort: takenPort, EtcdPeerPort: ports[0]})
	if err == nil {
		s.Stop()
		t.Fatalf("Start on the taken port %d succeeded", takenPort)
	}
	if !strings.Contains(err.Error(), strconv.Itoa(takenPort)) && !strings.Contains(err.Error(), "already in use") {
		t.Errorf("error %q names neither the port nor its being in use", err)
	}
	if d := time.Since(began); d > 30*time.Second {
		t.Errorf("the failed start took %s", d)
	}
	l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(ports[0]))
	if err != nil {
		t.Errorf("the peer port is still taken after the failed start: %v", err)
	} else {
		l.Close()
	}
	if _, err := testenv.Start(t.Context(), testenv.Config{EtcdClientPort: 1}); err == nil || !strings.Contains(err.Error(), "both etcd ports") {
		t.Errorf("one etcd port without the other: %v", err)
	}
}

// TestStartEndsWithItsContext: a context that ends first ends the wait.
func TestStartEndsWithItsContext(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if s, err := testenv.Start(ctx, testenv.Config{}); err == nil {
		s.Stop()
		t.Fatal("Start with an ended context succeeded")
	} else if !strings.Contains(err.Error(), context.Canceled.Error()) {
		t.Errorf("error %q, want the context's", err)
	}
}

// TestPrebuild: the command a fresh machine runs before the tests builds
// (or finds) the servers where the tests look for them.
func TestPrebuild(t *testing.T) {
	t.Parallel()
	bin := filepath.Join(t.TempDir(), "prebuild")
	if out, err := testproc.CombinedOutputLocked(testproc.InImageMode("build", "-o", bin, "./prebuild")); err != nil {
		t.Fatalf("building prebuild: %v\n%s", err, out)
	}
	out, err := exec.Command(bin).Output()
	if err != nil {
		t.Fatalf("prebuild: %v\n%s", err, out)
	}
	want := map[string]func(time.Time) (string, error){"etcd": etcdtest.Binary, "apiserver": k8stest.Binary}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) != len(want) {
		t.Fatalf("prebuild printed %q, want a line per server", out)
	}
	for _, line := range lines {
		name, path, _ := strings.Cut(line, "\t")
		binary, ok := want[name]
		if !ok {
			t.Fatalf("prebuild printed %q", line)
		}
		if got, err := binary(time.Time{}); err != nil || got != path {
			t.Errorf("%s: prebuild printed %s, the tests use %s (%v)", name, path, got, err)
		}
	}
}
