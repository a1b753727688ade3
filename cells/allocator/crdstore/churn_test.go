package crdstore

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/rest"

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
	cfg := GCConfig{Interval: c.Interval, RateLimit: int64(c.Limit), RateInterval: time.Minute, HeartbeatTimeout: c.HeartbeatTimeout}
	runChurn(t, c, srv.RESTConfig(), cfg, nil)
}

// TestChurnShort is TestChurnLevelsOff made short for make test, on an API
// server slow to answer the patches of CiliumIdentity objects (60 ms
// each): two nodes allocate the same 40 new label sets a second, each
// held 2 s, for 40 s, collecting every second with a grace and step
// window of a second; at the end there are at most the new sets of 12 s
// (the hold, three intervals, the grace and the step window, and 5 s for
// a loaded machine). With the collector's marks written one at a time,
// at most 16 a second, the identities grow past it (checked).
func TestChurnShort(t *testing.T) {
	srv := serialServer(t)
	slow := rest.CopyConfig(srv.RESTConfig())
	slow.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return roundTripFunc(func(r *http.Request) (*http.Response, error) {
			if r.Method == http.MethodPatch && strings.Contains(r.URL.Path, "/ciliumidentities/") {
				time.Sleep(60 * time.Millisecond)
			}
			return rt.RoundTrip(r)
		})
	})
	c := allocatortest.Churn{Duration: 40 * time.Second, Interval: time.Second, Hold: 2 * time.Second, Rate: 40, Limit: 6000}
	const grace = time.Second
	c.Life = c.Hold + 3*c.Interval + 2*grace + 5*time.Second
	cfg := GCConfig{Interval: c.Interval, RateLimit: int64(c.Limit), RateInterval: time.Minute, HeartbeatTimeout: grace}
	runChurn(t, c, slow, cfg, func(n *gcNode) {
		n.gc.minGrace, n.gc.stepWindow = grace, grace
	})
}

// runChurn runs c on two nodes of cfg without Cilium agents; adjust, when
// set, changes each node's store before it starts.
func runChurn(t *testing.T, c allocatortest.Churn, rc *rest.Config, cfg GCConfig, adjust func(*gcNode)) {
	t.Helper()
	var nodes []*gcNode
	var churn []allocatortest.ChurnNode
	for _, name := range []string{"node-a", "node-b"} {
		n := newGCNode(t, rc, name, cfg)
		n.cfg.IdentityGCCiliumAgents = false
		if adjust != nil {
			adjust(n)
		}
		n.start(t)
		nodes = append(nodes, n)
		churn = append(churn, func(ctx context.Context, lbls labels.Labels) (func(), error) {
			id, _, err := n.Allocate(ctx, lbls, n.refs.Record)
			return func() {
				if ref := n.refs.Remove(id); ref != nil {
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
			deleted += n.gcStats().Deleted
		}
		return objects, int(deleted)
	})
}
