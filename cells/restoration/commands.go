package restoration

import (
	"strconv"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/script"
	"github.com/spf13/pflag"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/shellfmt"
)

func newCommands(r *Restorer) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"identity/restore-status": statusCmd(r),
	})
}

// TableHeader names the columns of identity/restore-status's table.
func (Status) TableHeader() []string {
	return []string{"STATE", "RESTORED", "SKIPPED", "RENUMBERED", "PREFIXES", "PREFIXES-FAILED",
		"HELD-IDENTITIES", "HELD-PREFIXES", "WITHHELD", "RELEASED", "RELEASE"}
}

// TableRow is s as a row of identity/restore-status's table. The RELEASE
// column says when the release runs ("in 29s"), or "done" once it has.
func (s Status) TableRow() []string {
	u := func(n uint64) string { return strconv.FormatUint(n, 10) }
	release := "-"
	switch {
	case s.State == StateReleased:
		release = "done"
	case !s.ReleaseAt.IsZero():
		release = "in " + time.Until(s.ReleaseAt).Round(time.Second).String()
	}
	c := s.Counters
	return []string{string(s.State), u(c.Restored), u(c.Skipped), u(c.Renumbered),
		u(c.PrefixesRestored), u(c.PrefixesFailed), strconv.Itoa(s.HeldIdentities),
		strconv.Itoa(s.HeldPrefixes), strconv.Itoa(s.WithheldIDs), u(c.ReleasedAfterGrace), release}
}

// heldRow is one identity the restorer holds, for --held.
type heldRow struct {
	ID     identity.NumericIdentity `json:"id"`
	Labels []string                 `json:"labels"`
}

// TableHeader names the columns of identity/restore-status's table of
// held identities.
func (heldRow) TableHeader() []string { return []string{"ID", "LABELS"} }

// TableRow is one held identity's row of that table.
func (h heldRow) TableRow() []string {
	s := ""
	for i, l := range h.Labels {
		if i > 0 {
			s += ","
		}
		s += l
	}
	return []string{h.ID.String(), s}
}

func statusCmd(r *Restorer) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "Show what restoration restored, what it still holds and when it releases it",
			Detail: []string{
				"Restored identities and ipcache prefixes are held for the grace period",
				"(--identity-restore-grace-period); then the restorer releases them and",
				"those nobody took up in the meantime are freed.",
				"With --held, lists the identities the restorer still holds.",
			},
			Flags: func(fs *pflag.FlagSet) {
				shellfmt.AddFlag(fs)
				fs.Bool("held", false, "List the identities still held instead of the summary")
			},
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			format, err := shellfmt.NoArgsFormat(s, args)
			if err != nil {
				return nil, err
			}
			var out string
			if held, _ := s.Flags.GetBool("held"); held {
				ids := r.Held()
				rows := make([]heldRow, len(ids))
				for i, id := range ids {
					rows[i] = heldRow{ID: id.ID, Labels: id.Labels.Strings()}
				}
				out, err = shellfmt.Render(format, rows)
			} else {
				out, err = shellfmt.Render(format, []Status{r.Status()})
			}
			if err != nil {
				return nil, err
			}
			return func(*script.State) (string, string, error) { return out, "", nil }, nil
		},
	)
}
