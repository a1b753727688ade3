package crdstore

import (
	"context"
	"testing"
	"time"

	"github.com/identityd/identityd/internal/allocatortest"
	"github.com/identityd/identityd/labels"
)

// TestChurnLevelsOff: two nodes on a real API server allocate the same
// IDENTITYD_CHURN_RATE new label sets a second (default 40), each held
// 10 s, for IDENTITYD_CHURN_SECONDS (it runs only when that is set; 300
// for the full run), without Cilium agents, collecting every
// IDENTITYD_CHURN_GC_INTERVAL seconds (default 10) at
// IDENTITYD_CHURN_GC_LIMIT deletions a minute (default 2500): the number
// of identities levels off, growing less than 1/s over the last 100 s,
// and the collector deletes at least 95% of the new label sets the run
// delivered there (docs/benchmarks.md, "Identity churn").
func TestChurnLevelsOff(t *testing.T) {
	c := allocatortest.ChurnFromEnv(t)
	srv := startServer(t)
	cfg := GCConfig{Interval: c.Interval, RateLimit: int64(c.Limit), RateInterval: time.Minute, HeartbeatTimeout: MinHeartbeatTimeout}
	var nodes []*gcNode
	var churn []allocatortest.ChurnNode
	for _, name := range []string{"node-a", "node-b"} {
		n := &gcNode{Store: newGCStore(t, srv.RESTConfig(), name, cfg), refs: newTestRefs()}
		n.cfg.IdentityGCCiliumAgents = false
		ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
		if err := n.Start(ctx, nopEvents{}, n.refs); err != nil {
			t.Fatal(err)
		}
		cancel()
		t.Cleanup(func() { n.Stop(context.Background()) })
		nodes = append(nodes, n)
		churn = append(churn, func(ctx context.Context, lbls labels.Labels) (func(), error) {
			id, _, err := n.Allocate(ctx, lbls, n.refs.record)
			return func() {
				if ref := n.refs.remove(id); ref != nil {
					n.Release(context.Background(), ref)
				}
			}, err
		})
	}
	allocatortest.RunChurn(t, c, churn, func() (int, int) {
		s := nodes[0].ids
		s.mu.RLock()
		objects := len(s.byID)
		s.mu.RUnlock()
		var deleted uint64
		for _, n := range nodes {
			deleted += n.GCStats().Deleted
		}
		return objects, int(deleted)
	})
}
