package clustermesh

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/identityd/identityd/internal/eventually"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus/testutil"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/testhive"
	"github.com/identityd/identityd/labels"
)

func TestParseRemoteClusterConfig(t *testing.T) {
	local := identity.ClusterInfo{ID: 1, Name: "c1", MaxConnectedClusters: 255}
	for _, tc := range []struct {
		name, file, content, err string
	}{
		{"ok", "c2", "endpoints: [http://127.0.0.1:2379]\ncluster-id: 2\n", ""},
		{"tls", "c2", "endpoints: [https://e:2379]\ncluster-id: 2\ntrusted-ca-file: ca.crt\ncert-file: /abs/c.crt\nkey-file: c.key\n", ""},
		{"empty", "c2", "", "empty file"},
		{"not yaml", "c2", "endpoints: [", "invalid YAML"},
		{"unknown key", "c2", "endpoints: [http://e:2379]\ncluster-id: 2\ncertfile: x\n", "field certfile not found"},
		{"no endpoints", "c2", "cluster-id: 2\n", "no endpoints"},
		{"bad endpoint", "c2", "endpoints: [nohost]\ncluster-id: 2\n", `endpoint "nohost" is not a URL`},
		{"no id", "c2", "endpoints: [http://e:2379]\n", "cluster-id is missing or 0"},
		{"id range", "c2", "endpoints: [http://e:2379]\ncluster-id: 256\n", "invalid cluster ID 256: must be in 0..255"},
		{"own id", "c2", "endpoints: [http://e:2379]\ncluster-id: 1\n", "this cluster's own ID"},
		{"own name", "c1", "endpoints: [http://e:2379]\ncluster-id: 2\n", "this cluster's own name"},
		{"bad name", "C2", "endpoints: [http://e:2379]\ncluster-id: 2\n", "invalid cluster name"},
		{"default name", "default", "endpoints: [http://e:2379]\ncluster-id: 2\n", "cannot be named"},
		{"cert alone", "c2", "endpoints: [http://e:2379]\ncluster-id: 2\ncert-file: c\n", "cert-file and key-file must be given together"},
		{"user alone", "c2", "endpoints: [http://e:2379]\ncluster-id: 2\nusername: u\n", "username and password-file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := ParseRemoteClusterConfig([]byte(tc.content), "/mesh")
			if err == nil {
				err = validateRemote(tc.file, c, local)
			}
			switch {
			case tc.err == "" && err != nil:
				t.Fatalf("unexpected error: %v", err)
			case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
				t.Fatalf("error %v, want one containing %q", err, tc.err)
			}
			if tc.name == "tls" && (c.CAFile != "/mesh/ca.crt" || c.CertFile != "/abs/c.crt" || c.KeyFile != "/mesh/c.key") {
				t.Fatalf("paths not resolved against the directory: %+v", c)
			}
		})
	}
}

func TestReadConfigDir(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("c2", "endpoints: [http://e:2379]\ncluster-id: 2\n")
	write("c3", "endpoints: [http://e:2379]\ncluster-id: 2\n")
	write("c2.crt", "not a config")
	write(".hidden", "not a config")
	os.Mkdir(filepath.Join(dir, "..data"), 0o700)
	files, err := readConfigDir(dir, identity.ClusterInfo{ID: 1, Name: "c1"})
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != 2 || files["c2"].err != nil || files["c3"].err == nil ||
		!strings.Contains(files["c3"].err.Error(), "cluster-id 2 is already used by c2") {
		t.Fatalf("unexpected reading: %+v %+v", files["c2"], files["c3"])
	}
}

// meshNode is an agent of one cluster of a mesh.
type meshNode struct {
	alloc allocator.Allocator
	mesh  *Mesh
	h     *hive.Hive
}

func startMeshNode(tb testing.TB, c *etcdtest.Cluster, id uint32, name, meshDir string, timeout time.Duration) *meshNode {
	tb.Helper()
	n := &meshNode{}
	n.h = hive.New(
		statedir.Cell, job.Cell, statedb.Cell, kvstore.Cell, allocator.Cell, etcdstore.Cell, Cell,
		cell.Invoke(func(a allocator.Allocator, m *Mesh) { n.alloc, n.mesh = a, m }),
	)
	stateDir := tb.TempDir()
	hive.AddConfigOverride(n.h, func(cfg *statedir.Config) { cfg.StateDir = stateDir })
	hive.AddConfigOverride(n.h, func(cfg *kvstore.Config) {
		cfg.KVStoreEndpoints = c.Endpoints()
		cfg.NodeName = name + "-node"
		cfg.KVStoreDialTimeout = 10 * time.Second
		cfg.KVStoreRequestTimeout = 5 * time.Second
	})
	hive.AddConfigOverride(n.h, func(cfg *globalstore.Config) { cfg.IdentityGCInterval = 0 })
	hive.AddConfigOverride(n.h, func(cfg *allocator.Config) { cfg.ClusterID, cfg.ClusterName = id, name })
	hive.AddConfigOverride(n.h, func(cfg *Config) {
		cfg.ClusterMeshConfig = meshDir
		cfg.ClusterMeshRemoteTimeout = timeout
	})
	// The node stops when the test ends.
	if _, err := testhive.TryStart(tb, n.h, nil); err != nil {
		tb.Fatalf("starting node of %s: %v", name, err)
	}
	return n
}

// changeLog records an Observe stream.
type changeLog struct {
	mu      sync.Mutex
	changes []allocator.Change
}

func observe(tb testing.TB, a allocator.Allocator) *changeLog {
	l := &changeLog{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	a.Observe(ctx, func(c allocator.Change) {
		l.mu.Lock()
		l.changes = append(l.changes, c)
		l.mu.Unlock()
	}, func(error) { close(done) })
	tb.Cleanup(func() { cancel(); <-done })
	return l
}

// of returns the changes of one ID, as "upsert" and "delete".
func (l *changeLog) of(id identity.NumericIdentity) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, c := range l.changes {
		if c.Kind != allocator.ChangeSync && c.ID == id {
			out = append(out, c.Kind.String())
		}
	}
	return out
}

// checkNoDuplicates fails when an ID is upserted twice with the same labels
// or deleted twice without an upsert in between.
func (l *changeLog) checkNoDuplicates(tb testing.TB) {
	tb.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	last := map[identity.NumericIdentity]allocator.Change{}
	for _, c := range l.changes {
		if c.Kind == allocator.ChangeSync {
			continue
		}
		if p, ok := last[c.ID]; ok && p.Kind == c.Kind && p.Labels.Equal(c.Labels) {
			tb.Errorf("duplicate event: %s %d %s", c.Kind, c.ID, c.Labels)
		}
		last[c.ID] = c
	}
}

func writeMeshFile(tb testing.TB, dir, name string, id uint32, endpoints []string) {
	tb.Helper()
	content := fmt.Sprintf("endpoints: [%s]\ncluster-id: %d\n", strings.Join(endpoints, ", "), id)
	// Written beside and renamed, so that the poll never reads half a file.
	tmp := filepath.Join(dir, "."+name+".tmp")
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		tb.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, name)); err != nil {
		tb.Fatal(err)
	}
}

func remoteStatus(m *Mesh, name string) RemoteClusterStatus {
	for _, st := range m.Status() {
		if st.Name == name {
			return st
		}
	}
	return RemoteClusterStatus{}
}

// TestClusterMesh runs three clusters, each with its own etcd: identities
// allocated in clusters 2 and 3 appear on a node of cluster 1.
func TestClusterMesh(t *testing.T) {
	e1 := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	e2 := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	e3 := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	ctx := testCtx(t, 3*time.Minute)

	n2 := startMeshNode(t, e2, 2, "c2", "", time.Minute)
	n3 := startMeshNode(t, e3, 3, "c3", "", time.Minute)
	web2, _, err := n2.alloc.Allocate(ctx, labels.MustParse("k8s:app=web", "k8s:io.cilium.k8s.policy.cluster=c2"))
	if err != nil {
		t.Fatal(err)
	}
	db2, _, err := n2.alloc.Allocate(ctx, labels.MustParse("k8s:app=db", "k8s:io.cilium.k8s.policy.cluster=c2"))
	if err != nil {
		t.Fatal(err)
	}
	web3, _, err := n3.alloc.Allocate(ctx, labels.MustParse("k8s:app=web", "k8s:io.cilium.k8s.policy.cluster=c3"))
	if err != nil {
		t.Fatal(err)
	}
	c2 := identity.ClusterInfo{ID: 2, Name: "c2"}
	if web2.ID < c2.MinID() || web2.ID > c2.MaxID() {
		t.Fatalf("cluster 2 allocated %d, outside its range", web2.ID)
	}

	meshDir := t.TempDir()
	writeMeshFile(t, meshDir, "c2", 2, e2.Endpoints())
	writeMeshFile(t, meshDir, "c3", 3, e3.Endpoints())
	// Not a valid remote: this cluster's own ID.
	writeMeshFile(t, meshDir, "c9", 1, e3.Endpoints())
	const timeout = 4 * time.Second
	n1 := startMeshNode(t, e1, 1, "c1", meshDir, timeout)
	log := observe(t, n1.alloc)

	// Remote identities with their numbers, in lookups, List and Observe.
	for _, want := range []*identity.Identity{web2, db2, web3} {
		eventually.True(t, fmt.Sprintf("remote identity %d on cluster 1", want.ID), func() bool {
			got := n1.alloc.LookupByID(want.ID)
			return got != nil && got.Labels.Equal(want.Labels)
		})
		if got := n1.alloc.LookupByLabels(want.Labels); got == nil || got.ID != want.ID {
			t.Fatalf("lookup by labels of %v: %v", want.Labels, got)
		}
		eventually.True(t, "upsert observed", func() bool { return len(log.of(want.ID)) == 1 })
	}
	var remote int
	for _, e := range n1.alloc.List() {
		if e.Source == allocator.SourceRemote {
			remote++
		}
	}
	if remote != 3 {
		t.Fatalf("List has %d remote identities, want 3", remote)
	}
	if st := remoteStatus(n1.mesh, "c9"); !strings.Contains(st.LastError, "own ID") || st.Connected {
		t.Fatalf("status of the invalid file: %+v", st)
	}
	if st := remoteStatus(n1.mesh, "c2"); !st.Connected || !st.Synced || st.Identities != 2 || st.ClusterID != 2 {
		t.Fatalf("status of c2: %+v", st)
	}
	collector := newClusterMeshMetrics(n1.mesh).Collector
	if err := testutil.CollectAndCompare(collector, strings.NewReader(`
# HELP identityd_clustermesh_remote_cluster_identities Identities of the remote cluster this node knows
# TYPE identityd_clustermesh_remote_cluster_identities gauge
identityd_clustermesh_remote_cluster_identities{cluster="c2"} 2
identityd_clustermesh_remote_cluster_identities{cluster="c3"} 1
identityd_clustermesh_remote_cluster_identities{cluster="c9"} 0
`), "identityd_clustermesh_remote_cluster_identities"); err != nil {
		t.Fatal(err)
	}
	if n := testutil.CollectAndCount(collector); n != 15 {
		t.Fatalf("%d metrics for 3 remote clusters, want 15", n)
	}

	// Entries written by hand into cluster 2's etcd that it may not
	// claim: another cluster's ID, and labels naming another cluster.
	cli2 := e2.Client(t)
	put := func(id identity.NumericIdentity, l string) {
		t.Helper()
		if _, err := cli2.Put(ctx, etcdstore.MasterKeyPrefix+id.String(), labels.MustParse(strings.Split(l, " ")...).Canonical()); err != nil {
			t.Fatal(err)
		}
	}
	put(70000, "k8s:app=evil k8s:io.cilium.k8s.policy.cluster=c2")           // cluster 1's range
	put(c2.MinID()+5000, "k8s:app=evil k8s:io.cilium.k8s.policy.cluster=c3") // wrong cluster
	put(c2.MinID()+5001, "k8s:app=nolabel")                                  // no cluster label
	put(c2.MinID()+5002, "k8s:app=ok k8s:io.cilium.k8s.policy.cluster=c2")
	eventually.True(t, "rejections counted", func() bool {
		st := remoteStatus(n1.mesh, "c2")
		return st.Rejected == 3 && st.RejectedTotal == 3 && st.Identities == 3
	})
	for _, id := range []identity.NumericIdentity{70000, c2.MinID() + 5000, c2.MinID() + 5001} {
		if got := n1.alloc.LookupByID(id); got != nil {
			t.Fatalf("rejected entry %d visible: %v", id, got)
		}
		if got := log.of(id); len(got) != 0 {
			t.Fatalf("rejected entry %d observed: %v", id, got)
		}
	}
	// A valid entry overwritten with an invalid one is withdrawn.
	put(c2.MinID()+5002, "k8s:app=ok k8s:io.cilium.k8s.policy.cluster=c3")
	eventually.True(t, "overwritten entry withdrawn", func() bool { return n1.alloc.LookupByID(c2.MinID()+5002) == nil })
	if _, err := cli2.Delete(ctx, etcdstore.MasterKeyPrefix, clientv3.WithPrefix()); err != nil {
		t.Fatal(err)
	}
	// The allocator of cluster 2 re-creates the master keys it uses.
	eventually.True(t, "hand-written entries gone", func() bool {
		st := remoteStatus(n1.mesh, "c2")
		return st.Rejected == 0 && st.Identities == 2 &&
			n1.alloc.LookupByID(web2.ID) != nil && n1.alloc.LookupByID(db2.ID) != nil
	})

	// A short outage of cluster 2's etcd, with changes right after it:
	// only the changes are reported.
	e2.Member(0).Kill()
	eventually.True(t, "c2 seen down", func() bool { return !remoteStatus(n1.mesh, "c2").Connected })
	e2.Member(0).Restart()
	if _, err := n2.alloc.Release(ctx, db2); err != nil {
		t.Fatal(err)
	}
	if _, err := cli2.Delete(ctx, etcdstore.MasterKeyPrefix+db2.ID.String()); err != nil {
		t.Fatal(err)
	}
	api2, _, err := n2.alloc.Allocate(ctx, labels.MustParse("k8s:app=api", "k8s:io.cilium.k8s.policy.cluster=c2"))
	if err != nil {
		t.Fatal(err)
	}
	eventually.True(t, "c2 converged after the restart", func() bool {
		return n1.alloc.LookupByID(api2.ID) != nil && n1.alloc.LookupByID(db2.ID) == nil &&
			n1.alloc.LookupByID(web2.ID) != nil && remoteStatus(n1.mesh, "c2").Connected
	})
	log.checkNoDuplicates(t)

	// A longer outage withdraws the cluster's identities after the
	// timeout; they come back once it answers.
	before := log.of(web2.ID)
	e2.Member(0).Kill()
	eventually.Within(t, 30*time.Second, "c2's identities withdrawn", func() bool {
		return n1.alloc.LookupByID(web2.ID) == nil && n1.alloc.LookupByID(api2.ID) == nil
	})
	if n1.alloc.LookupByID(web3.ID) == nil {
		t.Fatal("cluster 3's identity withdrawn with cluster 2's")
	}
	e2.Member(0).Restart()
	eventually.Within(t, 30*time.Second, "c2's identities back", func() bool {
		return n1.alloc.LookupByID(web2.ID) != nil && n1.alloc.LookupByID(api2.ID) != nil
	})
	// Lookups answer from the mesh at once; Observe delivers on its own
	// goroutine, so its events may trail them.
	eventually.True(t, "c2's withdrawal and return observed", func() bool { return len(log.of(web2.ID)) >= len(before)+2 })
	if got, want := strings.Join(log.of(web2.ID), ","), strings.Join(append(before, "delete", "upsert"), ","); got != want {
		t.Fatalf("events of %d: %s, want %s", web2.ID, got, want)
	}
	log.checkNoDuplicates(t)

	// Removing the file withdraws every identity of the cluster.
	if err := os.Remove(filepath.Join(meshDir, "c2")); err != nil {
		t.Fatal(err)
	}
	eventually.True(t, "c2 removed", func() bool {
		return n1.alloc.LookupByID(web2.ID) == nil && n1.alloc.LookupByID(api2.ID) == nil
	})
	eventually.True(t, "deletes observed", func() bool {
		w, a := log.of(web2.ID), log.of(api2.ID)
		return len(w) > 0 && w[len(w)-1] == "delete" && len(a) > 0 && a[len(a)-1] == "delete"
	})
	if st := remoteStatus(n1.mesh, "c2"); st.Name != "" {
		t.Fatalf("removed cluster in status: %+v", st)
	}
	if n1.alloc.LookupByID(web3.ID) == nil {
		t.Fatal("cluster 3's identity withdrawn with cluster 2's")
	}
	log.checkNoDuplicates(t)
}

func testCtx(tb testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	tb.Cleanup(cancel)
	return ctx
}
