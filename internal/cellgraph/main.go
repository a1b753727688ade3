// Command cellgraph reduces the dependency graph that `identityd hive
// dot-graph` prints (one node per constructor and per provided type, about
// 40 constructors and 120 edges) to one node per cell package with one edge
// per dependency, which is what docs/cells.svg shows. It reads DOT on stdin
// and writes DOT on stdout:
//
//	identityd hive dot-graph | go run ./internal/cellgraph | dot -Tsvg -o docs/cells.svg
//
// It knows only the shape hive's DOT output has (clusters labelled with the
// constructor's package, edges from a constructor to the types it needs,
// dashed when optional, value groups as diamond nodes); anything else is
// ignored rather than guessed at.
package main

import (
	"bufio"
	"cmp"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"strings"
)

var (
	clusterStart = regexp.MustCompile(`^subgraph (cluster_\d+) \{$`)
	clusterLabel = regexp.MustCompile(`^label = "([^"]+)";$`)
	// A node declared inside a cluster: a type its constructor provides.
	typeNode = regexp.MustCompile(`^"([^"]+)" \[label=`)
	// constructor_N -> "type" [ltail=cluster_N ...]: N needs the type.
	needs = regexp.MustCompile(`^constructor_\d+ -> "([^"]+)" \[ltail=(cluster_\d+)( style=dashed)?\];$`)
	// "[type=T group=G]" -> "T[group=G]k": k is a member of the group.
	member = regexp.MustCompile(`^"(\[type=[^"]+\])" -> "([^"]+)";$`)
)

const (
	modulePrefix = "github.com/identityd/identityd/cells/"
	// hive's own package provides the lifecycle, logger, shutdowner and
	// flags that every cell needs: an edge from each would hide the rest.
	hivePackage = "github.com/cilium/hive"
	// Config structs are provided by hive's cell package on behalf of the
	// cell that declares them; the type's package names that cell.
	configPackage = "github.com/cilium/hive/cell"
)

type edge struct {
	from, to string
	optional bool
}

func main() {
	if err := run(os.Stdin, os.Stdout); err != nil {
		fmt.Fprintf(os.Stderr, "cellgraph: %s\n", err)
		os.Exit(1)
	}
}

func run(in io.Reader, out io.Writer) error {
	clusterPkg := map[string]string{} // cluster -> package path
	providedBy := map[string]string{} // type node -> cluster
	groupMembers := map[string][]string{}
	type need struct {
		cluster, node string
		optional      bool
	}
	var needsList []need

	var cluster string
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case clusterStart.MatchString(line):
			cluster = clusterStart.FindStringSubmatch(line)[1]
		case cluster != "" && clusterLabel.MatchString(line):
			clusterPkg[cluster] = clusterLabel.FindStringSubmatch(line)[1]
		case cluster != "" && typeNode.MatchString(line):
			providedBy[typeNode.FindStringSubmatch(line)[1]] = cluster
		case line == "}":
			cluster = ""
		case needs.MatchString(line):
			m := needs.FindStringSubmatch(line)
			needsList = append(needsList, need{m[2], m[1], m[3] != ""})
		case member.MatchString(line):
			m := member.FindStringSubmatch(line)
			groupMembers[m[1]] = append(groupMembers[m[1]], m[2])
		}
	}
	if err := sc.Err(); err != nil {
		return err
	}
	if len(needsList) == 0 {
		return fmt.Errorf("no dependencies found in the input: not the output of 'hive dot-graph'?")
	}

	// Each package path by the short name Go code uses for its types.
	byShort := map[string]string{}
	for _, pkg := range clusterPkg {
		byShort[pkg[strings.LastIndexByte(pkg, '/')+1:]] = pkg
	}
	pkgOf := func(cluster, node string) string {
		pkg := clusterPkg[cluster]
		if pkg == configPackage {
			short := strings.TrimLeft(node, "*")
			short, _, _ = strings.Cut(short, ".")
			if p, ok := byShort[short]; ok {
				return p
			}
			// The config of a package without constructors of its own
			// (globalstore.Config, which the allocator cell registers):
			// the graph does not say which cell registered it, so it is
			// left out like hive's own types.
			return hivePackage
		}
		return pkg
	}
	// A needed node's providers: its own, or every member's for a group.
	providers := func(node string) []string {
		if ms, ok := groupMembers[node]; ok {
			var out []string
			for _, m := range ms {
				if c, ok := providedBy[m]; ok {
					out = append(out, pkgOf(c, m))
				}
			}
			return out
		}
		if c, ok := providedBy[node]; ok {
			return []string{pkgOf(c, node)}
		}
		return nil
	}

	// An edge is optional only if every dependency behind it is.
	edges := map[[2]string]bool{}
	for _, n := range needsList {
		from := pkgOf(n.cluster, n.node)
		for _, to := range providers(n.node) {
			if from == to || to == hivePackage || from == hivePackage {
				continue
			}
			k := [2]string{name(from), name(to)}
			opt, seen := edges[k]
			edges[k] = n.optional && (!seen || opt)
		}
	}
	var list []edge
	nodes := map[string]bool{}
	for k, opt := range edges {
		list = append(list, edge{k[0], k[1], opt})
		nodes[k[0]], nodes[k[1]] = true, true
	}
	slices.SortFunc(list, func(a, b edge) int {
		return cmp.Or(cmp.Compare(a.from, b.from), cmp.Compare(a.to, b.to))
	})

	w := bufio.NewWriter(out)
	fmt.Fprintln(w, "digraph cells {")
	fmt.Fprintln(w, "\trankdir=LR;")
	fmt.Fprintln(w, `	label="An arrow points from a cell to a cell it needs; dashed: optional" labelloc=b fontname="Helvetica" fontsize=10;`)
	fmt.Fprintln(w, `	node [shape=box style="rounded,filled" fillcolor="#eef3fb" fontname="Helvetica" fontsize=12];`)
	fmt.Fprintln(w, `	edge [color="#44546a" arrowsize=0.7];`)
	for _, n := range slices.Sorted(mapsKeys(nodes)) {
		attrs := ""
		if !strings.HasPrefix(n, "cells/") {
			// Libraries' cells, not identityd's own.
			attrs = ` [fillcolor="#f2f2f2"]`
		}
		fmt.Fprintf(w, "\t%q%s;\n", n, attrs)
	}
	for _, e := range list {
		attrs := ""
		if e.optional {
			attrs = ` [style=dashed]`
		}
		fmt.Fprintf(w, "\t%q -> %q%s;\n", e.from, e.to, attrs)
	}
	fmt.Fprintln(w, "}")
	return w.Flush()
}

// name shortens a package path: cells/<name> for identityd's cells, the
// path below github.com/ for libraries.
func name(pkg string) string {
	if rest, ok := strings.CutPrefix(pkg, modulePrefix); ok {
		return "cells/" + rest
	}
	return strings.TrimPrefix(pkg, "github.com/")
}

func mapsKeys(m map[string]bool) func(func(string) bool) {
	return func(yield func(string) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}
