package main

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"testing"
	"time"
)

const modulePath = "github.com/identityd/identityd"

// layer is a group of packages of one rank in the import order of
// docs/architecture.md ("Imports point one way"). A package may import
// packages of its own layer and of lower ranks; two layers of one rank
// (checkpoint and ipcache; the allocator and the drivers) may not import
// each other.
type layer struct {
	name     string
	rank     int
	prefixes []string // module-relative package paths, each with its subpackages
}

// layers, longest prefixes first where they nest (the drivers under
// cells/allocator).
var layers = []layer{
	{"cmd", 7, []string{"cmd"}},
	{"restoration", 6, []string{"cells/restoration"}},
	// Pods to identities: above the allocator and the ipcache.
	{"workloads", 6, []string{"cells/workloads"}},
	{"checkpoint", 5, []string{"cells/checkpoint"}},
	// What composes both drivers: the double-write store, and the
	// one-shot copy between the two stores, which only cmd runs.
	{"two stores", 5, []string{"cells/allocator/doublewrite", "internal/migrate"}},
	{"ipcache", 5, []string{"cells/ipcache"}},
	{"contract", 3, []string{"cells/allocator/globalstore"}},
	{"drivers", 4, []string{"cells/allocator/etcdstore", "cells/allocator/crdstore", "cells/allocator/clustermesh"}},
	{"allocator", 4, []string{"cells/allocator"}},
	{"kvstore", 2, []string{"cells/kvstore"}},
	{"k8sclient", 2, []string{"cells/k8sclient"}},
	{"infrastructure", 1, []string{"cells/metrics", "cells/health", "cells/statedir", "cells/shell"}},
	// The domain model and the shared plumbing every layer may use.
	{"domain", 0, []string{"identity", "labels", "internal"}},
}

// layerOf returns the layer of a module-relative package path, or nil.
func layerOf(rel string) *layer {
	var best *layer
	bestLen := -1
	for i := range layers {
		for _, p := range layers[i].prefixes {
			if (rel == p || strings.HasPrefix(rel, p+"/")) && len(p) > bestLen {
				best, bestLen = &layers[i], len(p)
			}
		}
	}
	return best
}

// mayImport reports whether a package of layer from may import one of
// layer to.
func mayImport(from, to *layer) bool {
	return from == to || to.rank < from.rank
}

type listedPackage struct {
	ImportPath string
	Imports    []string
}

// listPackages runs `go list -deps` over the agent and every cell: the
// packages their non-test code builds from, with their non-test imports.
// Test files, and the test helpers only they import, are not in it.
func listPackages(t *testing.T) []listedPackage {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		goBin = filepath.Join(runtime.GOROOT(), "bin", "go")
	}
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, goBin, "list", "-deps", "-json=ImportPath,Imports",
		modulePath+"/cmd/...", modulePath+"/cells/...")
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("go list: %v\n%s", err, ee.Stderr)
		}
		t.Fatalf("go list: %v", err)
	}
	var pkgs []listedPackage
	dec := json.NewDecoder(strings.NewReader(string(out)))
	for {
		var p listedPackage
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("go list output: %v", err)
		}
		pkgs = append(pkgs, p)
	}
	return pkgs
}

// TestImportsPointOneWay fails when a package of the module's own code
// imports a package of a higher layer, or of another layer of its rank.
// The layers are those of docs/architecture.md: cmd → restoration →
// {checkpoint, ipcache} → {allocator, drivers} → contract, drivers →
// {kvstore, k8sclient} → infrastructure (metrics, health, statedir, shell) → domain
// (identity, labels, internal). Test helpers are exempt: they are not in
// the non-test build of the agent and the cells.
func TestImportsPointOneWay(t *testing.T) {
	parallelProcess(t)
	pkgs := listPackages(t)
	var violations []string
	seen := 0
	for _, p := range pkgs {
		rel, ok := strings.CutPrefix(p.ImportPath, modulePath+"/")
		if !ok {
			continue
		}
		seen++
		from := layerOf(rel)
		if from == nil {
			violations = append(violations, rel+": in no layer; add it to the layers of this test")
			continue
		}
		for _, imp := range p.Imports {
			irel, ok := strings.CutPrefix(imp, modulePath+"/")
			if !ok {
				continue
			}
			to := layerOf(irel)
			if to == nil {
				continue // reported as a package of its own
			}
			if !mayImport(from, to) {
				violations = append(violations, rel+" ("+from.name+") imports "+irel+" ("+to.name+")")
			}
		}
	}
	if seen < 10 {
		t.Fatalf("go list found %d packages of the module; the check would prove nothing", seen)
	}
	sort.Strings(violations)
	for _, v := range violations {
		t.Error(v)
	}
}

// The layer rules themselves: a check that allowed everything would pass
// on any tree.
func TestLayerRules(t *testing.T) {
	for _, tc := range []struct {
		from, to string
		ok       bool
	}{
		{"cells/restoration", "cells/checkpoint", true},
		{"cells/checkpoint", "cells/allocator", true},
		{"cells/allocator", "cells/allocator/globalstore", true},
		{"cells/allocator/etcdstore", "cells/allocator/globalstore", true},
		{"cells/allocator/etcdstore", "cells/kvstore", true},
		{"cells/allocator/crdstore", "cells/k8sclient", true},
		{"cells/k8sclient", "cells/allocator/crdstore", false},
		{"cells/allocator", "cells/allocator/crdstore", false},
		{"cells/allocator/clustermesh", "cells/allocator/etcdstore", true},
		{"cells/kvstore", "cells/metrics", true},
		{"cells/metrics", "cells/health", true},
		{"cells/ipcache", "internal/ipcachemap", true},
		{"cells/metrics", "cells/allocator", false},
		{"cells/metrics/scrape", "cells/kvstore", false},
		{"cells/kvstore", "cells/allocator/etcdstore", false},
		{"cells/allocator", "cells/allocator/etcdstore", false},
		{"cells/allocator/etcdstore", "cells/allocator", false},
		{"cells/allocator/globalstore", "cells/allocator", false},
		{"cells/ipcache", "cells/checkpoint", false},
		{"cells/checkpoint", "cells/restoration", false},
		{"identity", "cells/allocator", false},
		{"internal/ipcachemap", "cells/metrics", false},
	} {
		from, to := layerOf(tc.from), layerOf(tc.to)
		if from == nil || to == nil {
			t.Fatalf("%s or %s is in no layer", tc.from, tc.to)
		}
		if got := mayImport(from, to); got != tc.ok {
			t.Errorf("%s may import %s: %v, want %v", tc.from, tc.to, got, tc.ok)
		}
	}
}
