package crdstore

import (
	"fmt"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// samples gathers the store's collector through a pedantic registry (which
// checks descriptions against metrics) as "name{label=value}" -> value.
func samples(t testing.TB, s *Store) map[string]float64 {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(newStoreCollector(s))
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var ls []string
			for _, l := range m.GetLabel() {
				ls = append(ls, fmt.Sprintf("%s=%s", l.GetName(), l.GetValue()))
			}
			name := mf.GetName()
			if len(ls) > 0 {
				name += "{" + strings.Join(ls, ",") + "}"
			}
			v := m.GetCounter().GetValue() + m.GetGauge().GetValue()
			out[name] = v
		}
	}
	return out
}

func expectSamples(t testing.TB, got map[string]float64, want map[string]float64) {
	t.Helper()
	for name, w := range want {
		if g, ok := got[name]; !ok || g != w {
			t.Errorf("%s = %v (present %v), want %v", name, g, ok, w)
		}
	}
}
