package apicheck

import (
	"go/ast"
	"go/doc"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// publicDirs are the directories of publicPatterns.
var publicDirs = []string{"cells", "labels", "identity", "testenv"}

// internalNameRE matches a qualified name of one of the module's internal
// packages, like shellfmt.Tabular, in a comment.
func internalNameRE(t *testing.T) *regexp.Regexp {
	t.Helper()
	entries, err := os.ReadDir("..")
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		if e.IsDir() {
			names = append(names, regexp.QuoteMeta(e.Name()))
		}
	}
	return regexp.MustCompile(`\b(` + strings.Join(names, "|") + `)\.[A-Z]\w*`)
}

// exportedDocs returns the doc comments go doc shows for the package in
// dir: the package's, and those of its exported names, methods and struct
// fields, each keyed by the name it documents.
func exportedDocs(t *testing.T, dir string) map[string]string {
	t.Helper()
	fset := token.NewFileSet()
	matches, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	var files []*ast.File
	for _, m := range matches {
		if strings.HasSuffix(m, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, m, nil, parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	if len(files) == 0 {
		return nil
	}
	p, err := doc.NewFromFiles(fset, files, module+"/"+filepath.ToSlash(dir))
	if err != nil {
		t.Fatal(err)
	}
	docs := map[string]string{"package " + p.Name: p.Doc}
	// The table methods of the unexported types the cells' shell commands
	// print too: every cell has such rows, and their docs were the ones
	// to name the internal interface they satisfy. doc.New consumes the
	// files it reads, so these come from a fresh parse.
	all, err := doc.NewFromFiles(fset, parseAgain(t, fset, files), module+"/"+filepath.ToSlash(dir), doc.AllDecls)
	if err != nil {
		t.Fatal(err)
	}
	for _, typ := range all.Types {
		if ast.IsExported(typ.Name) {
			continue
		}
		for _, m := range typ.Methods {
			if m.Name == "TableHeader" || m.Name == "TableRow" {
				docs[typ.Name+"."+m.Name] = m.Doc
			}
		}
	}
	values := func(vs []*doc.Value) {
		for _, v := range vs {
			docs[strings.Join(v.Names, ", ")] = v.Doc
		}
	}
	funcs := func(fs []*doc.Func) {
		for _, f := range fs {
			name := f.Name
			if f.Recv != "" {
				name = f.Recv + "." + f.Name
			}
			docs[name] = f.Doc
		}
	}
	values(p.Consts)
	values(p.Vars)
	funcs(p.Funcs)
	for _, typ := range p.Types {
		docs[typ.Name] = typ.Doc
		values(typ.Consts)
		values(typ.Vars)
		funcs(typ.Funcs)
		funcs(typ.Methods)
		ast.Inspect(typ.Decl, func(n ast.Node) bool {
			field, ok := n.(*ast.Field)
			if !ok || field.Doc == nil {
				return true
			}
			for _, id := range field.Names {
				if id.IsExported() {
					docs[typ.Name+"."+id.Name] = field.Doc.Text()
				}
			}
			return true
		})
	}
	return docs
}

// parseAgain parses the files of files once more, for a second
// doc.NewFromFiles.
func parseAgain(t *testing.T, fset *token.FileSet, files []*ast.File) []*ast.File {
	t.Helper()
	var out []*ast.File
	for _, f := range files {
		g, err := parser.ParseFile(fset, fset.File(f.Pos()).Name(), nil, parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, g)
	}
	return out
}

// TestPublicDocsNameNoInternalType: the doc comments go doc shows for the
// public packages (and those of the table methods of the unexported rows
// their shell commands print) name no type of an internal package, which a
// reader outside the module can neither look up nor use.
func TestPublicDocsNameNoInternalType(t *testing.T) {
	re := internalNameRE(t)
	for _, root := range publicDirs {
		err := filepath.WalkDir(filepath.Join("../..", root), func(path string, d fs.DirEntry, err error) error {
			if err != nil || !d.IsDir() {
				return err
			}
			if d.Name() == "testdata" {
				return filepath.SkipDir
			}
			rel, _ := filepath.Rel("../..", path)
			for name, text := range exportedDocs(t, path) {
				for _, m := range re.FindAllString(text, -1) {
					t.Errorf("%s: the doc of %s names the internal %s", rel, name, m)
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
}

// TestInternalNameRE: the pattern finds an internal package's qualified
// name and leaves a public one alone.
func TestInternalNameRE(t *testing.T) {
	re := internalNameRE(t)
	for text, want := range map[string]bool{
		"TableRow implements shellfmt.Tabular.": true,
		"see kvstore.Client":                    false,
		"the shellfmt package":                  false,
	} {
		if got := re.MatchString(text); got != want {
			t.Errorf("%q: match %v, want %v", text, got, want)
		}
	}
}
