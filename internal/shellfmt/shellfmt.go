// Package shellfmt prints the objects of shell commands as a table, JSON or
// YAML (`-o table|json|yaml`), the same way for every cell.
package shellfmt

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/cilium/hive/script"
	"github.com/spf13/pflag"
	"go.yaml.in/yaml/v3"
)

// Formats accepted by -o.
const (
	Table = "table"
	JSON  = "json"
	YAML  = "yaml"
)

// AddFlag registers -o/--output on a command's flag set.
func AddFlag(fs *pflag.FlagSet) {
	fs.StringP("output", "o", Table, "Output format: table, json or yaml")
}

// Format reads -o from a command's flags and checks it.
func Format(fs *pflag.FlagSet) (string, error) {
	f, err := fs.GetString("output")
	if err != nil {
		return "", err
	}
	switch f {
	case Table, JSON, YAML:
		return f, nil
	}
	return "", fmt.Errorf("unknown output format %q (want table, json or yaml)", f)
}

// NoArgsFormat is Format for a command that takes no arguments: it fails
// with script.ErrUsage (which prints the usage) when args are given.
func NoArgsFormat(s *script.State, args []string) (string, error) {
	if len(args) > 0 {
		return "", script.ErrUsage
	}
	return Format(s.Flags)
}

// Notef logs a note for the reader of a table: with -o json or yaml it
// logs nothing, because the shell sends a command's log on the same
// stream as its output, and a line before the document would make it
// unreadable to a JSON or YAML decoder (`identityd shell -- ... -o json |
// jq`).
func Notef(s *script.State, format string, args ...any) {
	if f, err := Format(s.Flags); err == nil && f != Table {
		return
	}
	s.Logf(format, args...)
}

// Tabular is an object that can print itself as table rows.
type Tabular interface {
	TableHeader() []string
	TableRow() []string
}

// Render prints objs in the format: a table with one row per object, or the
// objects (as given, so their JSON tags apply) in JSON or YAML.
func Render[T Tabular](format string, objs []T) (string, error) {
	if objs == nil {
		// No objects is an empty list, not JSON's null.
		objs = []T{}
	}
	switch format {
	case JSON:
		b, err := json.MarshalIndent(objs, "", "  ")
		if err != nil {
			return "", err
		}
		return string(b) + "\n", nil
	case YAML:
		// Through JSON, so that YAML uses the same field names.
		b, err := json.Marshal(objs)
		if err != nil {
			return "", err
		}
		// Numbers stay json.Number: decoded into float64, IDs above 2^20
		// would print as 1.6777217e+07.
		dec := json.NewDecoder(bytes.NewReader(b))
		dec.UseNumber()
		var v any
		if err := dec.Decode(&v); err != nil {
			return "", err
		}
		v = yamlNumbers(v)
		var out bytes.Buffer
		enc := yaml.NewEncoder(&out)
		enc.SetIndent(2)
		if err := enc.Encode(v); err != nil {
			return "", err
		}
		return out.String(), nil
	default:
		var zero T
		var out strings.Builder
		tw := tabwriter.NewWriter(&out, 4, 8, 2, ' ', 0)
		fmt.Fprintln(tw, strings.Join(zero.TableHeader(), "\t"))
		for _, o := range objs {
			fmt.Fprintln(tw, strings.Join(o.TableRow(), "\t"))
		}
		tw.Flush()
		return out.String(), nil
	}
}

// yamlNumbers replaces the json.Numbers in v by integers (or floats when
// they have a fraction or exponent), which YAML prints as plain numbers;
// json.Number itself is a string to the YAML encoder and would be quoted.
func yamlNumbers(v any) any {
	switch v := v.(type) {
	case json.Number:
		if i, err := strconv.ParseInt(string(v), 10, 64); err == nil {
			return i
		}
		if u, err := strconv.ParseUint(string(v), 10, 64); err == nil {
			return u
		}
		if f, err := v.Float64(); err == nil {
			return f
		}
		return string(v)
	case map[string]any:
		for k, e := range v {
			v[k] = yamlNumbers(e)
		}
	case []any:
		for i, e := range v {
			v[i] = yamlNumbers(e)
		}
	}
	return v
}

// Output renders objs in the format of the command's -o flag as the
// command's stdout.
func Output[T Tabular](fs *pflag.FlagSet, objs []T) (script.WaitFunc, error) {
	format, err := Format(fs)
	if err != nil {
		return nil, err
	}
	out, err := Render(format, objs)
	if err != nil {
		return nil, err
	}
	return func(*script.State) (string, string, error) { return out, "", nil }, nil
}

// StatusCommand returns a command without arguments that asks conn's
// status method for the state of a connection (within 10s) and prints it:
// as text by table, or with -o json or yaml as the one object view makes
// of it. A nil conn (the hive has no such connection) fails with missing.
func StatusCommand[C any, S any, V Tabular](usage script.CmdUsage, conn *C, method func(*C, context.Context) S, table func(S) string, view func(S) V, missing error) script.Cmd {
	var status func(context.Context) S
	if conn != nil {
		status = func(ctx context.Context) S { return method(conn, ctx) }
	}
	usage.Flags = AddFlag
	return script.Command(usage, func(s *script.State, args ...string) (script.WaitFunc, error) {
		if len(args) > 0 {
			return nil, script.ErrUsage
		}
		if status == nil {
			return nil, missing
		}
		format, err := Format(s.Flags)
		if err != nil {
			return nil, err
		}
		ctx, cancel := context.WithTimeout(s.Context(), 10*time.Second)
		defer cancel()
		st := status(ctx)
		out := ""
		if format == Table {
			out = table(st)
		} else if out, err = Render(format, []V{view(st)}); err != nil {
			return nil, err
		}
		return func(*script.State) (string, string, error) { return out, "", nil }, nil
	})
}
