package kvstore_test

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/script"

	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/testhive"
)

// syncBuffer is a log sink that the hive's goroutines may write to while
// the test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// listeningSockets returns the TCP sockets this process listens on, as
// "inode" strings, read from /proc.
func listeningSockets(t *testing.T) map[string]bool {
	t.Helper()
	inodes := map[string]bool{}
	for _, f := range []string{"/proc/self/net/tcp", "/proc/self/net/tcp6"} {
		data, err := os.ReadFile(f)
		if errors.Is(err, os.ErrNotExist) {
			continue
		} else if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(data), "\n")[1:] {
			// sl local rem st tx:rx tr:when retrnsmt uid timeout inode
			fields := strings.Fields(line)
			if len(fields) > 9 && fields[3] == "0A" {
				inodes[fields[9]] = true
			}
		}
	}
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	own := map[string]bool{}
	for _, fd := range fds {
		link, err := os.Readlink(filepath.Join("/proc/self/fd", fd.Name()))
		if err != nil {
			continue
		}
		var inode string
		if _, err := fmt.Sscanf(link, "socket:[%s", &inode); err == nil {
			inode = strings.TrimSuffix(inode, "]")
			if inodes[inode] {
				own[inode] = true
			}
		}
	}
	return own
}

// crdNode is a hive of the kvstore cell in crd mode, as the allocator
// cell would configure it; its client and node name are set once it has
// started.
type crdNode struct {
	h      *hive.Hive
	logs   syncBuffer
	log    *slog.Logger
	client *kvstore.Client
	name   identity.NodeName
}

func newCRDNode(t *testing.T, stateDir string, configure func(*kvstore.Config)) *crdNode {
	n := &crdNode{}
	n.log = slog.New(slog.NewTextHandler(io.MultiWriter(&n.logs, t.Output()), nil))
	n.h = hive.New(
		statedir.Cell,
		kvstore.Cell,
		cell.Provide(func() identity.AllocationMode { return identity.AllocationModeCRD }),
		cell.Invoke(func(c *kvstore.Client, name identity.NodeName) { n.client, n.name = c, name }),
	)
	hive.AddConfigOverride(n.h, func(c *statedir.Config) { c.StateDir = stateDir })
	hive.AddConfigOverride(n.h, func(c *kvstore.Config) {
		c.NodeName = "crd-node"
		c.KVStoreDialTimeout = 10 * time.Second
		if configure != nil {
			configure(c)
		}
	})
	return n
}

func (n *crdNode) start(t *testing.T) error {
	_, err := testhive.TryStart(t, n.h, n.log)
	return err
}

// TestCRDModeWithoutEndpoints: in crd mode without --kvstore-endpoints the
// cell makes no client, starts no embedded etcd, creates no etcd
// directory, listens on nothing, says so in the log, and still provides
// the node name; kvstore/status says there is no client.
func TestCRDModeWithoutEndpoints(t *testing.T) {
	dir := t.TempDir()
	before := listeningSockets(t)
	n := newCRDNode(t, dir, nil)
	if err := n.start(t); err != nil {
		t.Fatal(err)
	}
	if n.client != nil {
		t.Fatalf("crd mode without endpoints made a client (endpoints %v)", n.client.Endpoints())
	}
	if n.name != "crd-node" {
		t.Fatalf("node name %q, want crd-node", n.name)
	}
	for _, sub := range []string{"etcd", "etcd-tls"} {
		if _, err := os.Stat(filepath.Join(dir, sub)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("<state-dir>/%s after a start in crd mode: %v", sub, err)
		}
	}
	for inode := range listeningSockets(t) {
		if !before[inode] {
			t.Errorf("a TCP socket (inode %s) listens after a start in crd mode", inode)
		}
	}
	const why = "No etcd client and no embedded etcd: --identity-allocation-mode=crd keeps global identities in the Kubernetes API server, and --kvstore-endpoints is empty"
	if !strings.Contains(n.logs.String(), why) {
		t.Errorf("the log does not say why there is no etcd: want %q", why)
	}

	cmds, err := n.h.ScriptCommands(n.log)
	if err != nil {
		t.Fatal(err)
	}
	s, err := script.NewState(t.Context(), t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	e := script.Engine{Cmds: cmds}
	err = e.ExecuteLine(s, "kvstore/status", io.Discard)
	if err == nil || !strings.Contains(err.Error(), "no etcd client: --identity-allocation-mode=crd without --kvstore-endpoints") {
		t.Fatalf("kvstore/status without a client: %v", err)
	}
}

// TestCRDModeWithEndpoints: in crd mode with --kvstore-endpoints the cell
// connects as in kvstore mode.
func TestCRDModeWithEndpoints(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	dir := t.TempDir()
	n := newCRDNode(t, dir, func(cfg *kvstore.Config) { cfg.KVStoreEndpoints = c.Endpoints() })
	if err := n.start(t); err != nil {
		t.Fatal(err)
	}
	if n.client == nil {
		t.Fatal("crd mode with endpoints made no client")
	}
	if st := n.client.Status(t.Context()); st.Connected() != 1 || st.Mode() != "external" {
		t.Fatalf("status in crd mode with endpoints: %+v", st)
	}
	if _, err := os.Stat(filepath.Join(dir, "etcd")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("<state-dir>/etcd with external endpoints: %v", err)
	}
}

// TestNodeNameProvided: the cell refuses an invalid --node-name in crd mode
// too, before anything starts, since the stores name this node by it.
func TestNodeNameProvided(t *testing.T) {
	dir := t.TempDir()
	n := newCRDNode(t, dir, func(cfg *kvstore.Config) { cfg.NodeName = "a/b" })
	err := n.start(t)
	if err == nil || !strings.Contains(err.Error(), `--node-name "a/b" must not contain '/'`) {
		t.Fatalf("invalid node name in crd mode: %v", err)
	}
}

// TestNodeNameLowerCaseInCRDMode: in crd mode the node name is also an
// object name, so an upper-case one is refused at start, naming the rule.
func TestNodeNameLowerCaseInCRDMode(t *testing.T) {
	n := newCRDNode(t, t.TempDir(), func(cfg *kvstore.Config) { cfg.NodeName = "Worker-1" })
	err := n.start(t)
	if err == nil || !strings.Contains(err.Error(), `--node-name "Worker-1" must be lower case and hold no '_' in crd mode`) {
		t.Fatalf("upper-case node name in crd mode: %v", err)
	}
}
