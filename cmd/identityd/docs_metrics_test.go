package main

import (
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/k8sclient"
	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
)

type agentCollectors struct {
	cell.In

	Collectors []prometheus.Collector `group:"identityd-metrics"`
}

var (
	descName   = regexp.MustCompile(`fqName: "([^"]+)"`)
	descLabels = regexp.MustCompile(`variableLabels: \{([^}]*)\}`)
	// A row of the metric table: | `name` | type | labels | meaning |
	docMetricRow = regexp.MustCompile("(?m)^\\| `(identityd_[a-z0-9_]+)` \\| [a-z]+ \\| ([^|]*) \\|")
)

// agentMetricLabels returns every metric the agent's cells describe, with
// its variable labels, without starting the agent.
func agentMetricLabels(t *testing.T) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	cells := slices.Clone(agentCells)
	if !slices.Contains(cells, k8sclient.Cell) {
		cells = append(cells, k8sclient.Cell)
	}
	h := hive.New(append(cells, cell.Invoke(func(in agentCollectors) {
		for _, c := range in.Collectors {
			if c == nil {
				continue
			}
			ch := make(chan *prometheus.Desc)
			go func() { c.Describe(ch); close(ch) }()
			for d := range ch {
				s := d.String()
				m := descName.FindStringSubmatch(s)
				if m == nil {
					t.Errorf("no name in %s", s)
					continue
				}
				var labels []string
				if l := descLabels.FindStringSubmatch(s); l != nil && l[1] != "" {
					labels = strings.Split(l[1], ",")
				}
				out[m[1]] = labels
			}
		}
	}))...)
	dir := t.TempDir()
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(h, func(c *metrics.Config) { c.PrometheusServeAddr = "127.0.0.1:0" })
	// The Kubernetes client and its metrics exist only when a server is
	// named or the mode is crd; Populate does not connect.
	hive.AddConfigOverride(h, func(c *k8sclient.Config) { c.K8sAPIServer = "https://127.0.0.1:6443" })
	// A double-write mode builds both stores and the double-write cell,
	// so that every store's metrics are described.
	hive.AddConfigOverride(h, func(c *allocator.Config) { c.IdentityAllocationMode = identity.AllocationModeDoubleWriteReadKVStore })
	if err := h.Populate(hivetest.Logger(t)); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestOperationsDocMetrics: every metric of docs/operations.md's table is
// one the agent's cells contribute to its registry, with the labels the
// table names.
func TestOperationsDocMetrics(t *testing.T) {
	doc, err := os.ReadFile(operationsDoc)
	if err != nil {
		t.Fatal(err)
	}
	served := agentMetricLabels(t)
	rows := docMetricRow.FindAllStringSubmatch(string(doc), -1)
	if len(rows) < 30 {
		t.Fatalf("%s: %d metric rows found; the table's format changed?", operationsDoc, len(rows))
	}
	for _, r := range rows {
		name, labelsCol := r[1], r[2]
		labels, ok := served[name]
		if !ok {
			t.Errorf("%s lists %s, which no cell of the agent describes", operationsDoc, name)
			continue
		}
		for _, l := range labels {
			if !strings.Contains(labelsCol, "`"+l+"`") {
				t.Errorf("%s: label %s of %s missing from its row", operationsDoc, l, name)
			}
		}
		if len(labels) == 0 && strings.TrimSpace(labelsCol) != "—" {
			t.Errorf("%s: %s has no labels, its row names %q", operationsDoc, name, labelsCol)
		}
	}
}
