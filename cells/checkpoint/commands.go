package checkpoint

import (
	"cmp"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/cilium/hive"
	"github.com/cilium/hive/script"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/durability"
	"github.com/identityd/identityd/internal/journal"
	"github.com/identityd/identityd/internal/shellfmt"
)

func newCommands(c *Checkpoint) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"checkpoint/write": writeCmd(c),
		"checkpoint/show":  showCmd(c),
	})
}

func writeCmd(c *Checkpoint) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "Write the local identity checkpoint now",
			Detail: []string{
				"Writes a snapshot of the allocator's local identities to the",
				"checkpoint file at once, without waiting for the interval.",
				"On a stalled disk it waits until the client gives up; the",
				"write goes on and lands once the disk answers.",
			},
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) != 0 {
				return nil, script.ErrUsage
			}
			// A write cannot be interrupted, but the command's wait can:
			// a client that closes its connection ends it.
			var st Status
			err := durability.Wait(s.Context(), func() (err error) {
				st, err = c.Write()
				return err
			})
			if err != nil {
				return nil, err
			}
			out := fmt.Sprintf("wrote %d identities (%d bytes) to %s in %s\n", st.Entries, st.Size, c.Path(), st.Duration)
			return stdout(out), nil
		},
	)
}

// showRow is one entry of the checkpoint file as checkpoint/show prints it
// with -o json or yaml. An entry that would not be restored has Invalid set
// (and no scope or labels), so that machine readers see it in the same list
// as the valid ones.
type showRow struct {
	ID      identity.NumericIdentity `json:"id"`
	Scope   string                   `json:"scope,omitempty"`
	Labels  []string                 `json:"labels,omitempty"`
	Invalid string                   `json:"invalid,omitempty"`
}

// TableHeader names the columns of checkpoint/show's table.
func (showRow) TableHeader() []string { return []string{"ID", "Scope", "Labels"} }

// TableRow is one checkpointed identity's row of that table.
func (r showRow) TableRow() []string {
	return []string{r.ID.String(), r.Scope, strings.Join(r.Labels, ",")}
}

func showCmd(c *Checkpoint) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "Show the identities in the checkpoint file",
			Args:    "[file]",
			Detail: []string{
				"Prints the identities of the checkpoint file as a table,",
				"followed by the entries that would not be restored. The file",
				"is read, never modified. Without an argument it is the agent's",
				"checkpoint with its journal of later changes replayed over it:",
				"what a restart would restore. With -o json or yaml, entries that would not be",
				"restored are in the list with their reason in \"invalid\".",
			},
			Flags: shellfmt.AddFlag,
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			format, err := shellfmt.Format(s.Flags)
			if err != nil {
				return nil, err
			}
			path := c.Path()
			switch len(args) {
			case 0:
			case 1:
				path = s.Path(args[0])
			default:
				return nil, script.ErrUsage
			}
			data, _, err := readBounded(path, MaxFileSize)
			var journalRecords [][]byte
			if len(args) == 0 && (err == nil || errors.Is(err, fs.ErrNotExist)) {
				// The agent's own state: the journal's records count,
				// if it follows the file read.
				journalRecords = c.journalRecords(journal.BaseOf(data))
			}
			if errors.Is(err, fs.ErrNotExist) && len(journalRecords) > 0 {
				data, err = []byte("[]"), nil
			}
			if errors.Is(err, fs.ErrNotExist) {
				if format != shellfmt.Table {
					// An empty list keeps the output parseable,
					// and nothing beside it.
					out, err := shellfmt.Render(format, []showRow{})
					return stdout(out), err
				}
				return stdout(fmt.Sprintf("no checkpoint at %s\n", path)), nil
			}
			if err != nil {
				return nil, fmt.Errorf("read %s: %w", path, err)
			}
			ids, invalid, err := Decode(data)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", path, err)
			}
			if len(journalRecords) > 0 {
				ids, _, _ = replay(ids, journalRecords)
			}
			// Files written by other agents may be in any order.
			slices.SortFunc(ids, func(a, b identity.Identity) int { return cmp.Compare(a.ID, b.ID) })
			if format != shellfmt.Table {
				rows := make([]showRow, 0, len(ids)+len(invalid))
				for _, id := range ids {
					rows = append(rows, showRow{ID: id.ID, Scope: id.ID.Scope().String(), Labels: id.Labels.Strings()})
				}
				for _, e := range invalid {
					rows = append(rows, showRow{ID: e.ID, Invalid: e.String()})
				}
				out, err := shellfmt.Render(format, rows)
				return stdout(out), err
			}
			// The table keeps its own layout, which other tools and tests
			// compare byte for byte.
			var b strings.Builder
			tw := tabwriter.NewWriter(&b, 5, 0, 3, ' ', 0)
			fmt.Fprintln(tw, "ID\tScope\tLabels")
			for _, id := range ids {
				fmt.Fprintf(tw, "%d\t%s\t%s\n", id.ID, id.ID.Scope(), id.Labels)
			}
			tw.Flush()
			for _, e := range invalid {
				fmt.Fprintf(&b, "invalid %s\n", e)
			}
			return stdout(b.String()), nil
		},
	)
}

// stdout makes out the command's standard output, which scripts can match.
func stdout(out string) script.WaitFunc {
	return func(*script.State) (string, string, error) { return out, "", nil }
}
