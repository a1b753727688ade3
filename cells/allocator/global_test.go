package allocator_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/identityd/identityd/internal/eventually"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/hive/script"
	"github.com/cilium/hive/script/scripttest"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/allocatortest"
	"github.com/identityd/identityd/internal/scriptengine"
	"github.com/identityd/identityd/internal/testhive"
	"github.com/identityd/identityd/labels"
)

// node starts a hive with the allocator cell and the given backend.
func node(t testing.TB, backend *allocatortest.Backend, cfg func(*allocator.Config)) (allocator.Allocator, *hive.Hive, error) {
	t.Helper()
	var a allocator.Allocator
	cells := []cell.Cell{
		job.Cell, statedb.Cell, allocator.Cell,
		cell.Invoke(func(x allocator.Allocator) { a = x }),
	}
	if backend != nil {
		cells = append(cells, allocatortest.BackendCell(backend))
	}
	h := hive.New(cells...)
	if cfg != nil {
		hive.AddConfigOverride(h, cfg)
	}
	if _, err := testhive.TryStart(t, h, nil); err != nil {
		return nil, h, err
	}
	return a, h, nil
}

func TestGlobalRequests(t *testing.T) {
	store := allocatortest.NewStore(identity.ClusterInfo{Name: "default"})
	b1, b2 := store.NewBackend("node1"), store.NewBackend("node2")
	n1, _, err := node(t, b1, nil)
	if err != nil {
		t.Fatal(err)
	}
	n2, _, err := node(t, b2, nil)
	if err != nil {
		t.Fatal(err)
	}
	web := labels.MustParse("k8s:app=web", "k8s:io.kubernetes.pod.namespace=default")

	id1, allocated, err := n1.Allocate(t.Context(), web)
	if err != nil || !allocated {
		t.Fatalf("first allocation: %v %v", allocated, err)
	}
	if id1.ID < identity.MinAllocatorIdentity || id1.ID > 65535 {
		t.Fatalf("global identity %d outside cluster 0's range", id1.ID)
	}
	if got := b1.Requests.Load(); got != 1 {
		t.Fatalf("new identity cost %d backend requests, want 1", got)
	}
	// A label set this node holds costs nothing.
	for range 100 {
		if id, _, err := n1.Allocate(t.Context(), web); err != nil || id.ID != id1.ID {
			t.Fatalf("hit: %v %v", id, err)
		}
	}
	if got := b1.Requests.Load(); got != 1 {
		t.Fatalf("held label set cost %d backend requests, want 0 more", got-1)
	}
	// Another node adopts the same ID.
	id2, allocated, err := n2.Allocate(t.Context(), web)
	if err != nil || allocated || id2.ID != id1.ID {
		t.Fatalf("adoption: id %v allocated %v err %v; want %d existing", id2, allocated, err, id1.ID)
	}
	if store.Refs(web) != 2 {
		t.Fatalf("store has %d references, want 2", store.Refs(web))
	}
	// Node 2 sees it by ID through the backend's cache.
	if got := n2.LookupByID(id1.ID); got == nil || !got.Labels.Equal(web) {
		t.Fatalf("node2 LookupByID = %v", got)
	}

	// Releases: only the last local reference reaches the store.
	for range 100 {
		if released, err := n1.Release(t.Context(), id1); err != nil || released {
			t.Fatalf("release of a multiply held identity: %v %v", released, err)
		}
	}
	if got := b1.Requests.Load(); got != 1 {
		t.Fatalf("non-final releases cost %d requests", got-1)
	}
	if released, err := n1.Release(t.Context(), id1); err != nil || !released {
		t.Fatalf("final release: %v %v", released, err)
	}
	if got := b1.Requests.Load(); got != 2 {
		t.Fatalf("final release: %d requests in all, want 2", got)
	}
	if store.Refs(web) != 1 {
		t.Fatalf("store has %d references after node1 released, want 1", store.Refs(web))
	}
	// Node 1 still knows the identity (node 2 holds it).
	if got := n1.LookupByID(id1.ID); got == nil {
		t.Fatal("node1 lost sight of an identity node2 holds")
	}
	if _, err := n2.Release(t.Context(), id2); err != nil {
		t.Fatal(err)
	}
	if store.GC() != 1 {
		t.Fatal("GC did not remove the unused identity")
	}
	eventually.True(t, "delete reaches node1", func() bool { return n1.LookupByID(id1.ID) == nil })
}

// TestGlobalAllocationTimeout checks that --identity-allocation-timeout
// bounds the calls that reach the backend, and that a held label set (a
// hit, a non-final release) needs no backend and so cannot time out.
func TestGlobalAllocationTimeout(t *testing.T) {
	store := allocatortest.NewStore(identity.ClusterInfo{Name: "default"})
	const timeout = 200 * time.Millisecond
	n, _, err := node(t, store.NewBackend("node1"), func(c *allocator.Config) { c.IdentityAllocationTimeout = timeout })
	if err != nil {
		t.Fatal(err)
	}
	web := labels.MustParse("k8s:app=web")
	held, _, err := n.Allocate(t.Context(), web)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := n.Allocate(t.Context(), web); err != nil {
		t.Fatal(err)
	}

	store.Stalled.Store(true)
	start := time.Now()
	_, _, err = n.Allocate(t.Context(), labels.MustParse("k8s:app=db"))
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("allocation against a stalled store: %v, want a deadline error", err)
	}
	if took := time.Since(start); took < timeout || took > 10*timeout {
		t.Fatalf("allocation gave up after %s, want about %s", took, timeout)
	}
	// The held set answers at once, stalled store or not.
	hitCtx, cancel := context.WithTimeout(t.Context(), timeout/4)
	defer cancel()
	if id, allocated, err := n.Allocate(hitCtx, web); err != nil || allocated || id.ID != held.ID {
		t.Fatalf("hit against a stalled store: %v %v %v", id, allocated, err)
	}
	for range 2 {
		if released, err := n.Release(hitCtx, held); err != nil || released {
			t.Fatalf("non-final release against a stalled store: %v %v", released, err)
		}
	}
	start = time.Now()
	if released, err := n.Release(t.Context(), held); !released || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("final release against a stalled store: %v %v, want released with a deadline error", released, err)
	}
	if took := time.Since(start); took < timeout || took > 10*timeout {
		t.Fatalf("release gave up after %s, want about %s", took, timeout)
	}
}

func TestGlobalStoreDown(t *testing.T) {
	store := allocatortest.NewStore(identity.ClusterInfo{Name: "default"})
	b := store.NewBackend("node1")
	a, _, err := node(t, b, nil)
	if err != nil {
		t.Fatal(err)
	}
	store.Down.Store(true)
	_, _, err = a.Allocate(t.Context(), labels.MustParse("k8s:app=db"))
	if !errors.Is(err, allocatortest.ErrDown) {
		t.Fatalf("allocation with the store down: %v", err)
	}
	// Nothing was recorded, so a later attempt goes to the store again.
	store.Down.Store(false)
	if _, allocated, err := a.Allocate(t.Context(), labels.MustParse("k8s:app=db")); err != nil || !allocated {
		t.Fatalf("allocation after recovery: %v %v", allocated, err)
	}
}

func TestGlobalSameSetConcurrently(t *testing.T) {
	store := allocatortest.NewStore(identity.ClusterInfo{Name: "default"})
	b := store.NewBackend("node1")
	a, _, err := node(t, b, nil)
	if err != nil {
		t.Fatal(err)
	}
	lbls := labels.MustParse("k8s:app=api")
	var wg sync.WaitGroup
	ids := make([]identity.NumericIdentity, 16)
	for i := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id, _, err := a.Allocate(context.Background(), lbls)
			if err != nil {
				t.Error(err)
				return
			}
			ids[i] = id.ID
		}()
	}
	wg.Wait()
	for _, id := range ids {
		if id != ids[0] {
			t.Fatalf("concurrent allocations of one set got %v", ids)
		}
	}
	if got := b.Requests.Load(); got != 1 {
		t.Fatalf("16 concurrent first allocations cost %d requests, want 1", got)
	}
}

func TestConfigValidation(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  func(*allocator.Config)
		want string
	}{
		{"nonzero ID with default name", func(c *allocator.Config) { c.ClusterID = 3 }, "cluster name other than"},
		{"ID above max", func(c *allocator.Config) { c.ClusterID = 256; c.ClusterName = "c1" }, "invalid cluster ID 256"},
		{"bad max", func(c *allocator.Config) { c.MaxConnectedClusters = 300 }, "must be 255 or 511"},
		{"bad name", func(c *allocator.Config) { c.ClusterName = "Bad_Name" }, "invalid cluster name"},
		{"zero timeout", func(c *allocator.Config) { c.IdentityAllocationTimeout = 0 }, "identity-allocation-timeout"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := node(t, nil, tc.cfg)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("start error %v, want one containing %q", err, tc.want)
			}
		})
	}
	// 511 mode with cluster 300 is fine.
	if _, _, err := node(t, nil, func(c *allocator.Config) {
		c.MaxConnectedClusters = 511
		c.ClusterID = 300
		c.ClusterName = "c300"
	}); err != nil {
		t.Fatalf("valid 511 config refused: %v", err)
	}
}

func TestScript(t *testing.T) {
	scripttest.Test(t, context.Background(),
		func(t testing.TB, args []string) *script.Engine {
			store := allocatortest.NewStore(identity.ClusterInfo{Name: "default"})
			h := hive.New(
				job.Cell, statedb.Cell, allocator.Cell,
				allocatortest.BackendCell(store.NewBackend("node1")),
			)
			scriptengine.ParseFlags(t, h, args)
			return scriptengine.New(t, h)
		}, nil, "testdata/*.txtar")
}

// modeNode starts a hive of the allocator with the given drivers (and
// other cells) and --identity-allocation-mode set from the command line.
func modeNode(t *testing.T, mode string, cells ...cell.Cell) (allocator.Allocator, identity.AllocationMode, error) {
	t.Helper()
	var a allocator.Allocator
	var m identity.AllocationMode
	h := hive.New(append([]cell.Cell{job.Cell, statedb.Cell, allocator.Cell,
		cell.Invoke(func(x allocator.Allocator, y identity.AllocationMode) { a, m = x, y })}, cells...)...)
	flags := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(flags)
	if err := flags.Parse([]string{"--identity-allocation-mode=" + mode}); err != nil {
		t.Fatal(err)
	}
	if _, err := testhive.TryStart(t, h, nil); err != nil {
		return nil, "", err
	}
	return a, m, nil
}

// TestAllocationModeSelectsDriver: the allocator sends global label sets
// to the driver of the configured mode, and a Backend provided on its own
// wins over every driver.
func TestAllocationModeSelectsDriver(t *testing.T) {
	cluster := identity.ClusterInfo{Name: "default"}
	web := labels.MustParse("k8s:app=web")
	for _, tc := range []struct {
		mode     identity.AllocationMode
		explicit bool
		want     string
	}{
		{identity.AllocationModeKVStore, false, "kvstore"},
		{identity.AllocationModeCRD, false, "crd"},
		{identity.AllocationModeCRD, true, "explicit"},
		{identity.AllocationModeKVStore, true, "explicit"},
	} {
		t.Run(fmt.Sprintf("%s/explicit=%v", tc.mode, tc.explicit), func(t *testing.T) {
			stores := map[string]*allocatortest.Store{}
			for _, name := range []string{"kvstore", "crd", "explicit"} {
				stores[name] = allocatortest.NewStore(cluster)
			}
			cells := []cell.Cell{
				allocatortest.DriverCell(identity.AllocationModeKVStore, stores["kvstore"].NewBackend("n")),
				allocatortest.DriverCell(identity.AllocationModeCRD, stores["crd"].NewBackend("n")),
			}
			if tc.explicit {
				explicit := stores["explicit"].NewBackend("n")
				cells = append(cells, allocatortest.BackendCell(explicit))
			}
			a, mode, err := modeNode(t, string(tc.mode), cells...)
			if err != nil {
				t.Fatal(err)
			}
			if mode != tc.mode {
				t.Fatalf("the hive's identity.AllocationMode is %q, want %q", mode, tc.mode)
			}
			if _, _, err := a.Allocate(t.Context(), web); err != nil {
				t.Fatal(err)
			}
			for name, s := range stores {
				if want := map[bool]int{true: 1}[name == tc.want]; s.Len() != want {
					t.Errorf("store %s holds %d identities, want %d", name, s.Len(), want)
				}
			}
		})
	}
}

// TestAllocationModeCRDNeedsDriver: crd mode in a hive without the CRD
// store fails at start, naming the mode and the missing cell, instead of
// serving local identities only; kvstore mode without a store does serve
// them, as it always has.
func TestAllocationModeCRDNeedsDriver(t *testing.T) {
	kv := allocatortest.DriverCell(identity.AllocationModeKVStore, allocatortest.NewStore(identity.ClusterInfo{Name: "default"}).NewBackend("n"))
	_, _, err := modeNode(t, "crd", kv)
	const want = "--identity-allocation-mode=crd needs the CRD store of global identities in the hive (crdstore.Cell)"
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("crd mode without a crd driver: %v, want an error containing %q", err, want)
	}
	a, _, err := modeNode(t, "kvstore")
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := a.Allocate(t.Context(), labels.MustParse("k8s:app=web")); !errors.Is(err, allocator.ErrNoGlobalBackend) {
		t.Fatalf("kvstore mode without a store: %v, want ErrNoGlobalBackend", err)
	}
	// A driver of the mode with a nil backend: no global identities.
	nilCRD := cell.Provide(func() globalstore.DriverOut { return globalstore.NewDriver(identity.AllocationModeCRD, nil) })
	if a, _, err = modeNode(t, "crd", nilCRD); err != nil {
		t.Fatal(err)
	}
	if _, _, err := a.Allocate(t.Context(), labels.MustParse("k8s:app=web")); !errors.Is(err, allocator.ErrNoGlobalBackend) {
		t.Fatalf("crd driver without a backend: %v, want ErrNoGlobalBackend", err)
	}
	// Two cells claiming one mode are refused.
	crd := func() cell.Cell {
		return allocatortest.DriverCell(identity.AllocationModeCRD, allocatortest.NewStore(identity.ClusterInfo{Name: "default"}).NewBackend("n"))
	}
	if _, _, err := modeNode(t, "crd", crd(), crd()); err == nil || !strings.Contains(err.Error(), "2 store cells in the hive serve it") {
		t.Fatalf("two crd drivers: %v", err)
	}
}

// TestAllocationModeFlag: an unknown --identity-allocation-mode is refused
// with the valid values.
func TestAllocationModeFlag(t *testing.T) {
	for _, mode := range []string{"etcd", "", "CRD"} {
		_, _, err := modeNode(t, mode)
		want := `invalid --identity-allocation-mode "` + mode + `": must be one of "kvstore", "crd", "doublewrite-readkvstore", "doublewrite-readcrd"`
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("--identity-allocation-mode=%q: %v, want %s", mode, err, want)
		}
	}
}

// globalBenchSets returns n distinct label sets of global identities.
func globalBenchSets(n int) []labels.Labels {
	out := make([]labels.Labels, n)
	for i := range out {
		out[i] = labels.MustParse("k8s:app=bench-"+strconv.Itoa(i), "k8s:io.kubernetes.pod.namespace=default")
	}
	return out
}

// globalBenchNode is an allocator over the in-memory global backend,
// holding sets.
func globalBenchNode(b *testing.B, sets []labels.Labels) allocator.Allocator {
	store := allocatortest.NewStore(identity.ClusterInfo{Name: "default"})
	a, _, err := node(b, store.NewBackend("node1"), nil)
	if err != nil {
		b.Fatal(err)
	}
	for _, s := range sets {
		if _, _, err := a.Allocate(b.Context(), s); err != nil {
			b.Fatal(err)
		}
	}
	return a
}

// BenchmarkGlobalHit measures taking another reference on a global
// identity this node holds: no backend call.
func BenchmarkGlobalHit(b *testing.B) {
	sets := globalBenchSets(1024)
	a := globalBenchNode(b, sets)
	ctx := context.Background()
	i := 0
	for b.Loop() {
		if _, allocated, err := a.Allocate(ctx, sets[i&1023]); err != nil || allocated {
			b.Fatal(err)
		}
		i++
	}
}

// BenchmarkGlobalHitParallel is BenchmarkGlobalHit from GOMAXPROCS
// goroutines.
func BenchmarkGlobalHitParallel(b *testing.B) {
	sets := globalBenchSets(1024)
	a := globalBenchNode(b, sets)
	ctx := context.Background()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			if _, _, err := a.Allocate(ctx, sets[i&1023]); err != nil {
				b.Error(err)
				return
			}
			i++
		}
	})
}

// TestHealthWithoutGlobalStore: a hive without a store of global
// identities reports the allocator OK for local identities, in words that
// do not assume etcd.
func TestHealthWithoutGlobalStore(t *testing.T) {
	var sh *cell.SimpleHealth
	h := hive.New(cell.SimpleHealthCell, job.Cell, statedb.Cell, allocator.Cell,
		cell.Invoke(func(s *cell.SimpleHealth) { sh = s }))
	testhive.Start(t, h)
	var status string
	eventually.True(t, "the allocator reports its health", func() bool {
		// The simple provider gives the allocator its root scope.
		c := sh
		c.Lock()
		defer c.Unlock()
		status = c.Status
		return c.Level == cell.StatusOK
	})
	if want := "no global identity store in the hive"; !strings.Contains(status, want) || strings.Contains(status, "kvstore") {
		t.Errorf("allocator health %q, want it to say %q and not name the kvstore", status, want)
	}
}

// TestAdoptOnly: an allocation that may only adopt fails at once with
// globalstore.ErrNoIdentity while the store holds no identity for the label
// set, and creates nothing; once another node created it, it takes that
// identity and the node's reference; node-local label sets are allocated
// as without it. Without the option the first allocation creates
// (checked by the count of identities).
func TestAdoptOnly(t *testing.T) {
	store := allocatortest.NewStore(identity.ClusterInfo{Name: "default"})
	manager, _, err := node(t, store.NewBackend("manager"), nil)
	if err != nil {
		t.Fatal(err)
	}
	agent, _, err := node(t, store.NewBackend("agent"), nil)
	if err != nil {
		t.Fatal(err)
	}
	web := labels.MustParse("k8s:app=web", "k8s:io.kubernetes.pod.namespace=default")
	if id, _, err := agent.Allocate(t.Context(), web, allocator.AdoptOnly()); !errors.Is(err, globalstore.ErrNoIdentity) {
		t.Fatalf("adopting a label set nobody created: %v, %v, want ErrNoIdentity", id, err)
	}
	if n := store.Len(); n != 0 {
		t.Fatalf("a refused adoption left %d identities in the store", n)
	}
	created, allocated, err := manager.Allocate(t.Context(), web)
	if err != nil || !allocated {
		t.Fatalf("the manager's allocation: %v, %v", allocated, err)
	}
	results := agent.AllocateBatch(t.Context(), []allocator.Request{{Labels: web, AdoptOnly: true}})
	if r := results[0]; r.Err != nil || r.Identity.ID != created.ID || r.Allocated {
		t.Fatalf("adopting the manager's identity %d: %+v", created.ID, r)
	}
	if n := store.Refs(web); n != 2 {
		t.Fatalf("%d nodes hold the label set, want the manager and the agent", n)
	}
	cidr := labels.MustParse("cidr:10.0.0.0/8")
	if id, _, err := agent.Allocate(t.Context(), cidr, allocator.AdoptOnly()); err != nil || !id.ID.HasLocalScope() {
		t.Fatalf("a node-local label set with AdoptOnly: %v, %v", id, err)
	}
}
