package etcdstore

import (
	"context"
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/metricstest"
	"github.com/identityd/identityd/internal/testhive"
	"github.com/identityd/identityd/labels"
)

// The etcd store's metrics, scraped from a hive with the allocator that
// drives the store.

func TestScrapeGC(t *testing.T) {
	var (
		alloc   allocator.Allocator
		backend globalstore.Backend
		server  *metrics.Server
	)
	h := hive.New(
		health.Cell, metrics.Cell, job.Cell, statedb.Cell, statedir.Cell,
		kvstore.Cell, allocator.Cell, Cell,
		cell.Invoke(func(a allocator.Allocator, b *Store, s *metrics.Server) {
			alloc, server = a, s
			if b != nil {
				backend = b
			}
		}),
	)
	dir := t.TempDir()
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(h, func(c *metrics.Config) { c.PrometheusServeAddr = "127.0.0.1:0" })
	// The test runs the GC itself, so that the counts are exact.
	hive.AddConfigOverride(h, func(c *globalstore.Config) { c.IdentityGCInterval = 0 })
	testhive.Start(t, h)
	etcd, ok := backend.(*Store)
	if !ok {
		t.Fatalf("global backend is %T, want the etcd backend", backend)
	}

	metricstest.Expect(t, metricstest.Scrape(t, server.Addr()), map[string]float64{
		`identityd_identity_gc_entries{status="deleted"}`: 0,
		`identityd_identity_gc_entries{status="skipped"}`: 0,
		`identityd_identity_gc_runs{outcome="success"}`:   0,
		`identityd_identity_gc_runs{outcome="failure"}`:   0,
	})

	// Two global identities nobody holds any more, one still held.
	var unused []*identity.Identity
	for _, app := range []string{"a", "b", "c"} {
		id, _, err := alloc.Allocate(t.Context(), labels.MustParse("k8s:app="+app))
		if err != nil {
			t.Fatal(err)
		}
		unused = append(unused, id)
	}
	for _, id := range unused[:2] {
		if _, err := alloc.Release(t.Context(), id); err != nil {
			t.Fatal(err)
		}
	}
	if res, err := etcd.collect(t.Context()); err != nil || res.Deleted != 2 {
		t.Fatalf("GC deleted %d, err %v; want 2", res.Deleted, err)
	}
	// A run that cannot reach etcd counts as a failure.
	cancelled, cancel := context.WithCancel(t.Context())
	cancel()
	if _, err := etcd.collect(cancelled); err == nil {
		t.Fatal("GC with a cancelled context succeeded")
	}
	metricstest.Expect(t, metricstest.Scrape(t, server.Addr()), map[string]float64{
		`identityd_identity_gc_entries{status="deleted"}`: 2,
		`identityd_identity_gc_entries{status="skipped"}`: 0,
		`identityd_identity_gc_runs{outcome="success"}`:   1,
		`identityd_identity_gc_runs{outcome="failure"}`:   1,
	})
}

func TestScrapeNodeChecks(t *testing.T) {
	var (
		alloc   allocator.Allocator
		backend globalstore.Backend
		kv      *kvstore.Client
		server  *metrics.Server
	)
	h := hive.New(
		health.Cell, metrics.Cell, job.Cell, statedb.Cell, statedir.Cell,
		kvstore.Cell, allocator.Cell, Cell,
		cell.Invoke(func(a allocator.Allocator, b *Store, k *kvstore.Client, s *metrics.Server) {
			alloc, kv, server = a, k, s
			if b != nil {
				backend = b
			}
		}),
	)
	dir := t.TempDir()
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(h, func(c *metrics.Config) { c.PrometheusServeAddr = "127.0.0.1:0" })
	hive.AddConfigOverride(h, func(c *kvstore.Config) { c.NodeName = "scraped" })
	// The test runs the checks itself, so that the counts are exact.
	hive.AddConfigOverride(h, func(c *Config) { c.KVStorePeriodicSync = 0 })
	testhive.Start(t, h)
	etcd := backend.(*Store)
	metricstest.Expect(t, metricstest.Scrape(t, server.Addr()), map[string]float64{
		`identityd_kvstore_node_name_conflicts_total`:  0,
		`identityd_kvstore_references_rewritten_total`: 0,
	})

	l := labels.MustParse("k8s:app=scraped")
	id, _, err := alloc.Allocate(t.Context(), l)
	if err != nil {
		t.Fatal(err)
	}
	// Another writer of this node's name rewrites its reference on
	// another lease.
	cli := kv.Client()
	other, err := cli.Grant(t.Context(), 60)
	if err != nil {
		t.Fatal(err)
	}
	ref := ReferenceKeyPrefix + l.Canonical() + "/scraped"
	if _, err := cli.Put(t.Context(), ref, id.ID.String(), clientv3.WithLease(other.ID)); err != nil {
		t.Fatal(err)
	}
	// The other writer's key is reported, never written over.
	if n, err := etcd.syncReferences(t.Context()); err != nil || n != 0 {
		t.Fatalf("sync rewrote %d, err %v; want 0", n, err)
	}
	metricstest.Expect(t, metricstest.Scrape(t, server.Addr()), map[string]float64{
		`identityd_kvstore_node_name_conflicts_total`:  1,
		`identityd_kvstore_references_rewritten_total`: 0,
	})
	// Once it is gone with its lease, the sync writes this node's again.
	if _, err := cli.Revoke(t.Context(), other.ID); err != nil {
		t.Fatal(err)
	}
	if n, err := etcd.syncReferences(t.Context()); err != nil || n != 1 {
		t.Fatalf("sync rewrote %d, err %v; want 1", n, err)
	}
	metricstest.Expect(t, metricstest.Scrape(t, server.Addr()), map[string]float64{
		`identityd_kvstore_node_name_conflicts_total`:  1,
		`identityd_kvstore_references_rewritten_total`: 1,
	})
}
