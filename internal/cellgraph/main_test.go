package main

import (
	"strings"
	"testing"
)

// A cut-down 'hive dot-graph': a cell with a config, one that needs it
// (and, optionally, the first), a value group, hive's own lifecycle, and
// a config of a package without a cell (as globalstore.Config).
const sample = `digraph {
	"[type=prometheus.Collector group=g]" [shape=diamond];
		"[type=prometheus.Collector group=g]" -> "prometheus.Collector[group=g]0";
		subgraph cluster_0 {
			label = "github.com/cilium/hive";
			constructor_0 [shape=plaintext label="f"];
			"cell.Lifecycle" [label=<cell.Lifecycle>];
		}
		subgraph cluster_1 {
			label = "github.com/cilium/hive/cell";
			constructor_1 [shape=plaintext label="(*config[...].func2"];
			"kvstore.Config" [label=<kvstore.Config>];
			"globalstore.Config" [label=<globalstore.Config>];
		}
		subgraph cluster_2 {
			label = "github.com/identityd/identityd/cells/kvstore";
			constructor_2 [shape=plaintext label="newClient"];
			"*kvstore.Client" [label=<*kvstore.Client>];
		}
			constructor_2 -> "kvstore.Config" [ltail=cluster_2];
			constructor_2 -> "cell.Lifecycle" [ltail=cluster_2];
			constructor_2 -> "globalstore.Config" [ltail=cluster_2];
		subgraph cluster_3 {
			label = "github.com/identityd/identityd/cells/metrics/scrape";
			constructor_3 [shape=plaintext label="out"];
			"prometheus.Collector[group=g]0" [label=<x>];
		}
			constructor_3 -> "*kvstore.Client" [ltail=cluster_3 style=dashed];
		subgraph cluster_4 {
			label = "github.com/identityd/identityd/cells/metrics";
			constructor_4 [shape=plaintext label="newRegistry"];
			"*prometheus.Registry" [label=<r>];
		}
			constructor_4 -> "[type=prometheus.Collector group=g]" [ltail=cluster_4];
}
`

func TestRun(t *testing.T) {
	var out strings.Builder
	if err := run(strings.NewReader(sample), &out); err != nil {
		t.Fatal(err)
	}
	got := out.String()
	for _, want := range []string{
		`"cells/metrics" -> "cells/metrics/scrape";`,
		`"cells/metrics/scrape" -> "cells/kvstore" [style=dashed];`,
	} {
		if !strings.Contains(got, want+"\n") {
			t.Errorf("missing %s in:\n%s", want, got)
		}
	}
	// The config is the kvstore cell's own; hive's lifecycle is left out.
	for _, unwanted := range []string{"hive/cell", `"cilium/hive"`, `"cells/kvstore" ->`} {
		if strings.Contains(got, unwanted) {
			t.Errorf("unexpected %s in:\n%s", unwanted, got)
		}
	}
}

func TestRunRejectsOtherInput(t *testing.T) {
	if err := run(strings.NewReader("digraph { a -> b; }\n"), new(strings.Builder)); err == nil {
		t.Fatal("no error for a graph without hive's constructors")
	}
}
