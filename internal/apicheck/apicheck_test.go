package apicheck

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// module is the import path of identityd's module.
const module = "github.com/identityd/identityd"

// publicPatterns are the packages whose exported API other agents import.
var publicPatterns = []string{"./cells/...", "./labels/...", "./identity/...", "./testenv/..."}

// listed is what `go list -export -json` says of one package.
type listed struct {
	ImportPath string
	Export     string
	DepOnly    bool
	Error      *struct{ Err string }
}

// exportData runs `go list -export -deps` on patterns in dir and returns an
// importer of the packages it lists, from their export data, and the
// listed packages themselves (not their dependencies): the test needs
// nothing but the go command. The export data is compiled with -race, as
// make test compiles every package: a plain build would compile the
// dependencies once more on a fresh machine.
func exportData(t *testing.T, fset *token.FileSet, dir string, env []string, patterns ...string) (types.Importer, []string) {
	t.Helper()
	cmd := exec.CommandContext(t.Context(), "go", append([]string{"list", "-race", "-export", "-deps", "-json=ImportPath,Export,DepOnly,Error"}, patterns...)...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list in %s: %v\n%s", dir, err, stderr.String())
	}
	exports := map[string]string{}
	var roots []string
	for dec := json.NewDecoder(bytes.NewReader(out)); ; {
		var p listed
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("decode go list output: %v", err)
		}
		if p.Error != nil {
			t.Fatalf("go list %s: %s", p.ImportPath, p.Error.Err)
		}
		exports[p.ImportPath] = p.Export
		if !p.DepOnly {
			roots = append(roots, p.ImportPath)
		}
	}
	imp := importer.ForCompiler(fset, "gc", func(path string) (io.ReadCloser, error) {
		f, ok := exports[path]
		if !ok || f == "" {
			return nil, fmt.Errorf("no export data for %s", path)
		}
		return os.Open(f)
	})
	return imp, roots
}

// loadPublic type-checks the public packages.
func loadPublic(t *testing.T) []*types.Package {
	t.Helper()
	imp, roots := exportData(t, token.NewFileSet(), "../..", nil, publicPatterns...)
	var pkgs []*types.Package
	for _, path := range roots {
		pkg, err := imp.Import(path)
		if err != nil {
			t.Fatalf("import %s: %v", path, err)
		}
		pkgs = append(pkgs, pkg)
	}
	return pkgs
}

// isInternal tells whether path is one of the module's internal packages.
func isInternal(path string) bool {
	if !strings.HasPrefix(path, module+"/") {
		return false
	}
	return strings.Contains(path+"/", "/internal/")
}

// internalTypes returns the internal types that t names, looking through
// pointers, slices, maps, channels, signatures, type arguments, aliases and
// the structure of unnamed types. The underlying type of a named type is
// not followed: its own exported API is checked where it is declared.
func internalTypes(t types.Type) []string {
	var found []string
	seen := map[types.Type]bool{}
	var walk func(types.Type)
	walk = func(t types.Type) {
		if t == nil || seen[t] {
			return
		}
		seen[t] = true
		switch t := t.(type) {
		case *types.Alias:
			if obj := t.Obj(); obj.Pkg() != nil && isInternal(obj.Pkg().Path()) {
				found = append(found, obj.Pkg().Path()+"."+obj.Name())
			}
			walk(types.Unalias(t))
		case *types.Named:
			if obj := t.Obj(); obj.Pkg() != nil && isInternal(obj.Pkg().Path()) {
				found = append(found, obj.Pkg().Path()+"."+obj.Name())
			}
			for a := range t.TypeArgs().Types() {
				walk(a)
			}
		case *types.Pointer:
			walk(t.Elem())
		case *types.Slice:
			walk(t.Elem())
		case *types.Array:
			walk(t.Elem())
		case *types.Map:
			walk(t.Key())
			walk(t.Elem())
		case *types.Chan:
			walk(t.Elem())
		case *types.Signature:
			for v := range t.Params().Variables() {
				walk(v.Type())
			}
			for v := range t.Results().Variables() {
				walk(v.Type())
			}
		case *types.Struct:
			for f := range t.Fields() {
				if f.Exported() || f.Embedded() {
					walk(f.Type())
				}
			}
		case *types.Interface:
			for m := range t.Methods() {
				if m.Exported() {
					walk(m.Type())
				}
			}
			for e := range t.EmbeddedTypes() {
				walk(e)
			}
		case *types.Union:
			for term := range t.Terms() {
				walk(term.Type())
			}
		case *types.TypeParam:
			walk(t.Constraint())
		}
	}
	walk(t)
	return found
}

// exportedAPI calls check for every exported name of pkg with the type an
// importer sees: functions, variables and constants; the definition of each
// type (the aliased type, or the underlying type's exported fields and
// methods); and the exported methods of each named type.
func exportedAPI(pkg *types.Package, check func(name string, t types.Type)) {
	scope := pkg.Scope()
	for _, name := range scope.Names() {
		obj := scope.Lookup(name)
		if !obj.Exported() {
			continue
		}
		tn, ok := obj.(*types.TypeName)
		if !ok {
			check(name, obj.Type())
			continue
		}
		if tn.IsAlias() {
			check(name, obj.Type())
			continue
		}
		named, ok := obj.Type().(*types.Named)
		if !ok {
			continue
		}
		check(name, named.Underlying())
		for tp := range named.TypeParams().TypeParams() {
			check(name, tp)
		}
		for m := range named.Methods() {
			if m.Exported() {
				check(name+"."+m.Name(), m.Type())
			}
		}
	}
}

// TestPublicAPINamesNoInternalType fails when an exported name of a public
// package mentions a type of an internal package: an agent composing the
// cells in its own module could call such a method but could not declare a
// variable of its result, nor write a function that takes it.
func TestPublicAPINamesNoInternalType(t *testing.T) {
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("the go command is needed to build the export data")
	}
	var problems []string
	for _, pkg := range loadPublic(t) {
		exportedAPI(pkg, func(name string, typ types.Type) {
			for _, in := range internalTypes(typ) {
				problems = append(problems, fmt.Sprintf("%s.%s names %s", pkg.Path(), name, in))
			}
		})
	}
	slices.Sort(problems)
	problems = slices.Compact(problems)
	for _, p := range problems {
		t.Error(p)
	}
}

// TestInternalTypesFindsEveryShape keeps the walk honest: each shape an
// exported signature can take must lead to the internal type inside it.
func TestInternalTypesFindsEveryShape(t *testing.T) {
	internal := types.NewPackage(module+"/internal/x", "x")
	public := types.NewPackage(module+"/cells/y", "y")
	inner := types.NewNamed(types.NewTypeName(token.NoPos, internal, "Entry", nil), types.Typ[types.Int], nil)
	alias := types.NewAlias(types.NewTypeName(token.NoPos, public, "Entry", nil), inner)
	result := types.NewTuple(types.NewVar(token.NoPos, public, "", types.NewSlice(inner)))
	shapes := map[string]types.Type{
		"named":     inner,
		"alias":     alias,
		"pointer":   types.NewPointer(inner),
		"map":       types.NewMap(types.Typ[types.String], inner),
		"chan":      types.NewChan(types.RecvOnly, inner),
		"result":    types.NewSignatureType(nil, nil, nil, nil, result, false),
		"field":     types.NewStruct([]*types.Var{types.NewField(token.NoPos, public, "E", inner, false)}, nil),
		"embedded":  types.NewStruct([]*types.Var{types.NewField(token.NoPos, internal, "Entry", inner, true)}, nil),
		"interface": types.NewInterfaceType([]*types.Func{types.NewFunc(token.NoPos, public, "Get", types.NewSignatureType(nil, nil, nil, nil, result, false))}, nil),
	}
	for name, typ := range shapes {
		if got := internalTypes(typ); len(got) == 0 {
			t.Errorf("%s: no internal type found in %s", name, typ)
		}
	}
	hidden := types.NewStruct([]*types.Var{types.NewField(token.NoPos, public, "e", inner, false)}, nil)
	if got := internalTypes(hidden); len(got) != 0 {
		t.Errorf("an unexported field is no part of the API, found %v", got)
	}
}

// composeDir is the example agent of another module that composes the cells.
const composeDir = "../../docs/examples/compose"

// TestComposeExampleCallsEveryMethod checks that the compose example calls
// every method, of the types its api struct collects from the cells, that
// returns a value other than an error: building the example then proves
// that another module can name the types of all those values. Methods that
// return nothing or only an error name no type of the API.
func TestComposeExampleCallsEveryMethod(t *testing.T) {
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("the go command is needed to build the export data")
	}
	fset := token.NewFileSet()
	// As make compose-example builds it.
	imp, _ := exportData(t, fset, composeDir, []string{"GOFLAGS=-mod=mod"}, ".")
	names, err := filepath.Glob(filepath.Join(composeDir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	var files []*ast.File
	for _, name := range names {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	info := &types.Info{Selections: map[*ast.SelectorExpr]*types.Selection{}}
	pkg, err := (&types.Config{Importer: imp}).Check("main", fset, files, info)
	if err != nil {
		t.Fatalf("type-check the compose example: %v", err)
	}
	called := map[*types.Func]bool{}
	for _, sel := range info.Selections {
		if f, ok := sel.Obj().(*types.Func); ok && sel.Kind() == types.MethodVal {
			called[f.Origin()] = true
		}
	}

	obj := pkg.Scope().Lookup("api")
	if obj == nil {
		t.Fatal("the compose example has no api struct")
	}
	st, ok := obj.Type().Underlying().(*types.Struct)
	if !ok {
		t.Fatalf("api is a %s, want a struct", obj.Type().Underlying())
	}
	errType := types.Universe.Lookup("error").Type()
	checked := 0
	for field := range st.Fields() {
		if !field.Exported() {
			continue
		}
		ms := types.NewMethodSet(field.Type())
		for sel := range ms.Methods() {
			m := sel.Obj().(*types.Func)
			if !m.Exported() || m.Pkg() == nil || !strings.HasPrefix(m.Pkg().Path(), module+"/") {
				continue
			}
			returnsValue := false
			for r := range m.Signature().Results().Variables() {
				if !types.Identical(r.Type(), errType) {
					returnsValue = true
				}
			}
			if !returnsValue {
				continue
			}
			checked++
			if !called[m.Origin()] {
				t.Errorf("the compose example never calls %s.%s, which returns a value", field.Type(), m.Name())
			}
		}
	}
	if checked == 0 {
		t.Fatal("no method of the api struct's types was checked")
	}
}
