// Package docs_test checks that the names the documentation writes in
// backquotes exist in the code: every flag (`--name`), metric
// (`identityd_...`), identifier (`pkg.Name`, `pkg.Type.Method`), shell
// command (`group/verb`) and job health scope (`module.job-name`) of
// docs/*.md and README.md. A renamed or removed name fails it until the
// documentation follows. It reads the module's Go files with go/parser
// and needs nothing else.
package docs_test

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/spf13/pflag"
)

// moduleRoot is the directory of go.mod, seen from this package.
const moduleRoot = ".."

// foreignPackages are packages outside this module whose names the
// documentation writes as pkg.Name; their names are not checked.
var foreignPackages = map[string]bool{
	"cell": true, "hive": true, "job": true, "statedb": true, "reconciler": true,
	"slog": true, "os": true, "time": true, "context": true, "prometheus": true,
	"pflag": true, "cobra": true, "metav1": true, "clientv3": true, "embed": true,
	"fstest": true, "errors": true, "http": true, "script": true, "hivetest": true,
	"path": true, "debug": true, "concurrency": true, "testing": true,
}

// foreignFlags are flags of other programs (kube-apiserver, etcd, kubectl,
// go) that the documentation names in backquotes.
var foreignFlags = map[string]bool{
	"help":                   true, // cobra's, on every command
	"fixed-identity-mapping": true, // Cilium's agent
	"read-only":              true, // docker and podman run
	"cap-drop":               true,
	"cap-add":                true,
}

// statedbCommands are the shell commands of statedb's db/* group, which
// the shell serves beside the cells' own.
var statedbCommands = map[string]bool{
	"db": true, "db/show": true, "db/cmp": true, "db/empty": true, "db/insert": true,
	"db/delete": true, "db/get": true, "db/prefix": true, "db/list": true,
	"db/lowerbound": true, "db/watch": true, "db/initialized": true,
}

// code is what the module's non-test Go files declare.
type code struct {
	flags    map[string]bool            // names given to pflag's flag constructors
	literals map[string]bool            // every string literal
	modules  map[string]bool            // IDs given to cell.Module
	commands map[string]bool            // keys of the shell command maps (commands.go)
	groups   map[string]bool            // the part before the / of those keys
	decls    map[string]map[string]bool // package name -> top-level names
	members  map[string]map[string]bool // "pkg.Type" -> methods and fields
	tests    map[string]bool            // Test, Benchmark and Fuzz functions
}

// flagConstructors are the methods of pflag.FlagSet that register a flag
// (a name, a default or a variable, and the usage last), each with the
// index of its name argument and its number of arguments.
func flagConstructors() map[string][2]int {
	out := map[string][2]int{}
	t := reflect.TypeOf(&pflag.FlagSet{})
	for i := range t.NumMethod() {
		m := t.Method(i).Type // In(0) is the receiver
		if m.NumIn() < 4 || m.In(m.NumIn()-1).Kind() != reflect.String {
			continue
		}
		switch {
		case m.In(1).Kind() == reflect.String:
			out[t.Method(i).Name] = [2]int{0, m.NumIn() - 1}
		case m.In(2).Kind() == reflect.String:
			out[t.Method(i).Name] = [2]int{1, m.NumIn() - 1}
		}
	}
	return out
}

var testFunc = regexp.MustCompile(`^(Test|Benchmark|Fuzz)([A-Z0-9_]|$)`)

// readCode parses every Go file of the module, outside testdata and the
// example modules of docs/: declarations of non-test files, and the test
// functions of test files.
func readCode(t *testing.T) *code {
	t.Helper()
	c := &code{
		flags: map[string]bool{}, literals: map[string]bool{}, modules: map[string]bool{},
		commands: map[string]bool{}, groups: map[string]bool{},
		decls: map[string]map[string]bool{}, members: map[string]map[string]bool{},
		tests: map[string]bool{},
	}
	ctors := flagConstructors()
	consts := map[string]string{}
	var flagArgs []ast.Expr
	fset := token.NewFileSet()
	err := filepath.WalkDir(moduleRoot, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			switch d.Name() {
			case ".git", ".bin", "testdata", "examples", "node_modules":
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		if strings.HasSuffix(path, "_test.go") {
			// Of a test file only its tests count: the documentation
			// cites them by name.
			for _, decl := range f.Decls {
				if fn, ok := decl.(*ast.FuncDecl); ok && fn.Recv == nil && testFunc.MatchString(fn.Name.Name) {
					c.tests[fn.Name.Name] = true
					c.tests[strings.TrimSuffix(f.Name.Name, "_test")+"."+fn.Name.Name] = true
				}
			}
			return nil
		}
		pkg := f.Name.Name
		if c.decls[pkg] == nil {
			c.decls[pkg] = map[string]bool{}
		}
		for _, decl := range f.Decls {
			switch decl := decl.(type) {
			case *ast.FuncDecl:
				if decl.Recv == nil {
					c.decls[pkg][decl.Name.Name] = true
				} else if len(decl.Recv.List) == 1 {
					c.member(pkg, receiverName(decl.Recv.List[0].Type), decl.Name.Name)
				}
			case *ast.GenDecl:
				for _, spec := range decl.Specs {
					switch spec := spec.(type) {
					case *ast.TypeSpec:
						c.decls[pkg][spec.Name.Name] = true
						if st, ok := spec.Type.(*ast.StructType); ok {
							for _, field := range st.Fields.List {
								for _, n := range field.Names {
									c.member(pkg, spec.Name.Name, n.Name)
								}
							}
						}
					case *ast.ValueSpec:
						for i, n := range spec.Names {
							c.decls[pkg][n.Name] = true
							if i < len(spec.Values) {
								if s, ok := stringLit(spec.Values[i]); ok {
									consts[n.Name] = s
								}
							}
						}
					}
				}
			}
		}
		inCommands := filepath.Base(path) == "commands.go"
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.BasicLit:
				if s, ok := stringLit(n); ok {
					c.literals[s] = true
				}
			case *ast.KeyValueExpr:
				if s, ok := stringLit(n.Key); ok && inCommands {
					c.commands[s] = true
					group, _, _ := strings.Cut(s, "/")
					c.groups[group] = true
				}
			case *ast.CallExpr:
				sel, ok := n.Fun.(*ast.SelectorExpr)
				if !ok {
					return true
				}
				if x, ok := sel.X.(*ast.Ident); ok && x.Name == "cell" && sel.Sel.Name == "Module" && len(n.Args) > 0 {
					if s, ok := stringLit(n.Args[0]); ok {
						c.modules[s] = true
					}
				}
				if ctor, ok := ctors[sel.Sel.Name]; ok && len(n.Args) == ctor[1] {
					flagArgs = append(flagArgs, n.Args[ctor[0]])
				}
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, arg := range flagArgs {
		if s, ok := stringLit(arg); ok {
			c.flags[s] = true
		} else if id, ok := arg.(*ast.Ident); ok && consts[id.Name] != "" {
			c.flags[consts[id.Name]] = true
		}
	}
	if len(c.flags) < 20 || len(c.commands) < 5 || len(c.modules) < 5 {
		t.Fatalf("found %d flags, %d shell commands, %d modules in the code: the way they are declared changed?", len(c.flags), len(c.commands), len(c.modules))
	}
	return c
}

func (c *code) member(pkg, typ, name string) {
	key := pkg + "." + typ
	if c.members[key] == nil {
		c.members[key] = map[string]bool{}
	}
	c.members[key][name] = true
}

// receiverName is the type name of a method's receiver.
func receiverName(e ast.Expr) string {
	switch e := e.(type) {
	case *ast.StarExpr:
		return receiverName(e.X)
	case *ast.IndexExpr:
		return receiverName(e.X)
	case *ast.IndexListExpr:
		return receiverName(e.X)
	case *ast.Ident:
		return e.Name
	}
	return ""
}

func stringLit(e ast.Expr) (string, bool) {
	lit, ok := e.(*ast.BasicLit)
	if !ok || lit.Kind != token.STRING {
		return "", false
	}
	s, err := strconv.Unquote(lit.Value)
	return s, err == nil
}

// span is one backquoted text of a document.
type span struct {
	file string
	line int
	text string
}

var codeSpan = regexp.MustCompile("`([^`\n]+)`")

// docSpans returns the backquoted texts of docs/*.md and README.md,
// outside fenced blocks.
func docSpans(t *testing.T) []span {
	t.Helper()
	files, err := filepath.Glob("*.md")
	if err != nil {
		t.Fatal(err)
	}
	files = append(files, filepath.Join(moduleRoot, "README.md"))
	var out []span
	for _, file := range files {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		fenced := false
		for i, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(strings.TrimSpace(l), "```") {
				fenced = !fenced
				continue
			}
			if fenced {
				continue
			}
			for _, m := range codeSpan.FindAllStringSubmatch(l, -1) {
				out = append(out, span{file: filepath.Base(file), line: i + 1, text: m[1]})
			}
		}
	}
	if len(out) < 100 {
		t.Fatalf("found %d backquoted names in the documentation", len(out))
	}
	return out
}

var (
	flagName = regexp.MustCompile(`^--([a-z0-9][a-z0-9-]*)`)
	// A metric, a family (identityd_kvstore_*) or a choice
	// (identityd_doublewrite_{crd,kvstore}_identities).
	metricPattern = regexp.MustCompile(`^identityd_[a-z0-9_{},*]+`)
	testName      = regexp.MustCompile(`^[A-Za-z0-9_]+$`)
	identName     = regexp.MustCompile(`^([a-z][a-z0-9]*)\.([A-Z][A-Za-z0-9_]*)(?:\.([A-Z][A-Za-z0-9_]*))?(?:\(.*\))?$`)
	commandName   = regexp.MustCompile(`^([a-z0-9]+)/([a-z0-9-]+)(?:\s|$)`)
	jobScope      = regexp.MustCompile(`^(?:([a-z0-9-]+)\.)?job-([a-z0-9-]+)$`)
)

// TestDocNamesExist: every flag, metric, identifier, shell command and
// job scope the documentation names in backquotes exists in the code.
func TestDocNamesExist(t *testing.T) {
	c := readCode(t)
	var missing []string
	bad := func(s span, format string, args ...any) {
		missing = append(missing, fmt.Sprintf("%s:%d: `%s`: ", s.file, s.line, s.text)+fmt.Sprintf(format, args...))
	}
	checked := 0
	for _, s := range docSpans(t) {
		text := s.text
		if m := flagName.FindStringSubmatch(text); m != nil {
			checked++
			if strings.HasPrefix(text[len(m[0]):], "*") {
				if !c.anyFlagWithPrefix(m[1]) {
					bad(s, "no flag --%s* is registered", m[1])
				}
			} else if !c.flags[m[1]] && !foreignFlags[m[1]] {
				bad(s, "no flag --%s is registered", m[1])
			}
			continue
		}
		if m := metricPattern.FindString(stripLabels(text)); m != "" {
			checked++
			for _, name := range expand(m) {
				if !c.metric(name) {
					bad(s, "no metric %s is defined", name)
				}
			}
			continue
		}
		if testFunc.MatchString(text) && testName.MatchString(text) {
			checked++
			if !c.tests[text] {
				bad(s, "no test %s", text)
			}
			continue
		}
		if m := identName.FindStringSubmatch(text); m != nil {
			pkg, name, member := m[1], m[2], m[3]
			if foreignPackages[pkg] {
				continue
			}
			checked++
			decls, ok := c.decls[pkg]
			switch {
			case !ok:
				bad(s, "no package %s in the module", pkg)
			case !decls[name] && !c.tests[pkg+"."+name]:
				bad(s, "package %s declares no %s", pkg, name)
			case member != "" && !c.members[pkg+"."+name][member]:
				bad(s, "%s.%s has no method or field %s", pkg, name, member)
			}
			continue
		}
		if m := commandName.FindStringSubmatch(text); m != nil && (c.groups[m[1]] || m[1] == "db") {
			checked++
			cmd := m[1] + "/" + m[2]
			if !c.commands[cmd] && !statedbCommands[cmd] {
				bad(s, "no shell command %s", cmd)
			}
			continue
		}
		if m := jobScope.FindStringSubmatch(text); m != nil {
			checked++
			if m[1] != "" && !c.modules[m[1]] {
				bad(s, "no module %s", m[1])
			} else if !c.literals[m[2]] {
				bad(s, "no job %s", m[2])
			}
		}
	}
	sort.Strings(missing)
	for _, m := range missing {
		t.Error(m)
	}
	if checked < 100 {
		t.Errorf("checked %d names; the documentation's way of writing them changed?", checked)
	}
	t.Logf("checked %d names", checked)
}

// metric reports whether the code defines the metric name (a trailing *
// for any of a family), given whole or without the namespace, as
// prometheus composes it; a histogram's series count as its name.
func (c *code) metric(name string) bool {
	name = strings.TrimPrefix(name, "identityd_")
	if prefix, ok := strings.CutSuffix(name, "*"); ok {
		for l := range c.literals {
			l = strings.TrimPrefix(strings.TrimPrefix(l, "identityd"), "_")
			if strings.HasPrefix(l, prefix) && l != prefix {
				return true
			}
		}
		return false
	}
	for _, n := range []string{name, strings.TrimSuffix(name, "_bucket"), strings.TrimSuffix(name, "_sum"), strings.TrimSuffix(name, "_count")} {
		if c.literals[n] || c.literals["_"+n] || c.literals["identityd_"+n] {
			return true
		}
		// A cell's prefix joined to each of its names
		// ("checkpoint_" + "pending").
		for i := 1; i < len(n); i++ {
			if n[i-1] == '_' && c.literals[n[:i]] && c.literals[n[i:]] {
				return true
			}
		}
	}
	return false
}

// stripLabels cuts a trailing label selector or label list
// (name{scope="global"}, name{reason}) off a metric's name; a choice of
// parts (name_{a,b}_total) stays.
func stripLabels(text string) string {
	i := strings.LastIndex(text, "{")
	if i < 0 || !strings.HasSuffix(text, "}") {
		return text
	}
	if inner := text[i+1 : len(text)-1]; strings.Contains(inner, "=") || !strings.Contains(inner, ",") {
		return text[:i]
	}
	return text
}

func (c *code) anyFlagWithPrefix(prefix string) bool {
	for f := range c.flags {
		if strings.HasPrefix(f, prefix) {
			return true
		}
	}
	return false
}

// expand returns the names a{b,c}d stands for: abd and acd.
func expand(pattern string) []string {
	i := strings.Index(pattern, "{")
	j := strings.Index(pattern, "}")
	if i < 0 || j < i {
		return []string{pattern}
	}
	var out []string
	for _, alt := range strings.Split(pattern[i+1:j], ",") {
		out = append(out, expand(pattern[:i]+alt+pattern[j+1:])...)
	}
	return out
}

var mdLink = regexp.MustCompile(`\]\(([^)\s]+)\)`)

// TestDocLinks: every link of docs/*.md and README.md to a file of the
// repository reaches it, and to a section (#anchor) reaches a heading of
// that page.
func TestDocLinks(t *testing.T) {
	files, err := filepath.Glob("*.md")
	if err != nil {
		t.Fatal(err)
	}
	files = append(files, filepath.Join(moduleRoot, "README.md"))
	anchors := map[string]map[string]bool{}
	headings := func(path string) map[string]bool {
		if a, ok := anchors[path]; ok {
			return a
		}
		a := map[string]bool{}
		b, err := os.ReadFile(path)
		if err != nil {
			return nil
		}
		fenced := false
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "```") {
				fenced = !fenced
			}
			if !fenced && strings.HasPrefix(l, "#") {
				a[headingAnchor(l)] = true
			}
		}
		anchors[path] = a
		return a
	}
	links := 0
	for _, file := range files {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for i, l := range strings.Split(string(b), "\n") {
			for _, m := range mdLink.FindAllStringSubmatch(l, -1) {
				target := m[1]
				if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
					continue
				}
				links++
				path, anchor, _ := strings.Cut(target, "#")
				if path == "" {
					path = file
				} else {
					path = filepath.Join(filepath.Dir(file), path)
				}
				if _, err := os.Stat(path); err != nil {
					t.Errorf("%s:%d: link to %s: no such file", file, i+1, target)
					continue
				}
				if anchor != "" && !headings(path)[anchor] {
					t.Errorf("%s:%d: link to %s: no such heading", file, i+1, target)
				}
			}
		}
	}
	if links < 10 {
		t.Errorf("found %d links", links)
	}
}

// headingAnchor is the anchor GitHub gives a Markdown heading: lower case,
// spaces to hyphens, other punctuation dropped.
func headingAnchor(h string) string {
	h = strings.ToLower(strings.TrimSpace(strings.TrimLeft(h, "#")))
	var b strings.Builder
	for _, r := range h {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9':
			b.WriteRune(r)
		}
	}
	return b.String()
}
