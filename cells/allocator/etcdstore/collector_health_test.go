package etcdstore

import (
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"

	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/eventually"
)

// TestEtcdCollectorHealthFollowsHolder: a candidate's health names the
// node that collects now, as Collector does, also after the collector it
// first saw stopped and another candidate took over while it waited.
func TestEtcdCollectorHealthFollowsHolder(t *testing.T) {
	c := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	withGC := func(_ *kvstore.Config, e *storeConfig) {
		e.IdentityGCInterval = 200 * time.Millisecond
		e.IdentityGCRateLimit = 1_000_000
	}
	n1 := startEtcdNode(t, c, "node1", withGC)
	eventually.True(t, "node1 collects", func() bool { return n1.backend.Collecting() })
	n2 := startEtcdNode(t, c, "node2", withGC)
	// node2's key is older than node3's: it collects once node1 stops.
	eventually.True(t, "node2 is a candidate", func() bool {
		name, ok := n2.backend.collectorSeen()
		return ok && name == "node1"
	})
	n3, p3 := startEtcdNodeWithHealth(t, c, "node3", withGC)

	says := func(node string) func() bool {
		return func() bool {
			for _, st := range p3.All() {
				if st.Level == cell.StatusOK && strings.Contains(st.Message, candidateMessage(node)) {
					return true
				}
			}
			return false
		}
	}
	eventually.True(t, "node3's health names node1", says("node1"))
	n1.stop()
	eventually.True(t, "node2 collects", func() bool { return n2.backend.Collecting() })
	eventually.True(t, "node3 sees node2 collect", func() bool {
		name, ok := n3.backend.collectorSeen()
		return ok && name == "node2"
	})
	if !says("node2")() {
		t.Fatalf("node3's Collector names node2, its health does not:\n%s", health.Format(p3.All()))
	}
	if says("node1")() {
		t.Fatalf("node3's health still names node1:\n%s", health.Format(p3.All()))
	}
}

// startEtcdNodeWithHealth is startEtcdNode with the health cell, whose
// provider it returns too.
func startEtcdNodeWithHealth(tb testing.TB, c *etcdtest.Cluster, name string, opts ...nodeOpt) (*etcdNode, *health.Provider) {
	tb.Helper()
	var p *health.Provider
	hopts := hive.DefaultOptions()
	hopts.ModuleDecorators = health.ModuleDecorators
	n := startEtcdNodeWith(tb, c, name, hopts, []cell.Cell{
		health.Cell,
		cell.Invoke(func(hp *health.Provider) { p = hp }),
	}, opts...)
	return n, p
}
