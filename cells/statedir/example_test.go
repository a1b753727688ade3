package statedir_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/spf13/pflag"

	"github.com/identityd/identityd/cells/statedir"
)

// startAgent starts a hive of the state directory on dir.
func startAgent(dir string) (*hive.Hive, *statedir.Dir, error) {
	var d *statedir.Dir
	h := hive.New(statedir.Cell, cell.Invoke(func(x *statedir.Dir) { d = x }))
	fs := pflag.NewFlagSet("agent", pflag.ContinueOnError)
	h.RegisterFlags(fs)
	fs.Set("state-dir", dir)
	return h, d, h.Start(slog.New(slog.DiscardHandler), context.Background())
}

// The cell creates the directory with mode 0700 and locks it: a second
// agent on the same directory fails to start with ErrLocked.
func Example() {
	parent, err := os.MkdirTemp("", "statedir-example")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(parent)
	dir := filepath.Join(parent, "state")

	first, d, err := startAgent(dir)
	if err != nil {
		panic(err)
	}
	defer first.Stop(slog.New(slog.DiscardHandler), context.Background())
	fi, _ := os.Stat(d.Path())
	fmt.Println(fi.Mode().Perm(), filepath.Base(d.Join("checkpoint.json")))

	_, _, err = startAgent(dir)
	fmt.Println("second agent locked out:", errors.Is(err, statedir.ErrLocked))
	// Output:
	// -rwx------ checkpoint.json
	// second agent locked out: true
}
