package allocator

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

func TestAllocationDurationMetric(t *testing.T) {
	a, _, _ := testAllocator(t, 3)
	a.metrics = newAllocationMetrics().Metrics
	for i := range 2 {
		mustAlloc(t, a, cidr("10.0.0.0/8"))
		mustAlloc(t, a, cidr([]string{"10.1.0.0/16", "10.2.0.0/16"}[i]))
	}
	// The scope is full now: one failure.
	a.Allocate(context.Background(), cidr("10.3.0.0/16"))
	// Global without a backend: a failure in the global scope.
	a.Allocate(context.Background(), labels.MustParse("k8s:app=x"))
	// Reserved sets are not allocations and are not observed.
	a.Allocate(context.Background(), identity.LookupReservedByID(1).Labels)

	got := map[string]int{}
	for _, s := range []struct{ scope, outcome string }{
		{"local", "success"}, {"local", "failure"}, {"global", "failure"}, {"global", "success"}, {"remote-node", "success"},
	} {
		h := a.metrics.Duration.WithLabelValues(s.scope, s.outcome)
		var m dto.Metric
		if err := h.(prometheus.Metric).Write(&m); err != nil {
			t.Fatal(err)
		}
		got[s.scope+"/"+s.outcome] = int(m.GetHistogram().GetSampleCount())
	}
	for k, w := range map[string]int{"local/success": 4, "local/failure": 1, "global/failure": 1, "global/success": 0, "remote-node/success": 0} {
		if got[k] != w {
			t.Errorf("%s: %d observations, want %d", k, got[k], w)
		}
	}
	if n := testutil.CollectAndCount(a.metrics.Duration); n != 6 {
		t.Errorf("%d series, want the 6 pre-resolved ones", n)
	}
	if _, err := testutil.CollectAndLint(a.metrics.Duration); err != nil {
		t.Error(err)
	}
}
