package health

import (
	"fmt"
	"strings"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/script"

	"github.com/identityd/identityd/internal/shellfmt"
)

func newCommands(p *Provider) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{"health": healthCmd(p)})
}

// statusRow is a Status as the health command prints it with -o json or
// yaml, with the field names of the other commands' objects.
type statusRow struct {
	Name    string `json:"name"`
	Level   string `json:"level"`
	Message string `json:"message,omitempty"`
	Error   string `json:"error,omitempty"`
	// External says the Degraded report's cause lies outside the agent.
	External bool       `json:"external,omitempty"`
	Updated  *time.Time `json:"updated,omitempty"`
}

// TableHeader names a health row's columns; the table itself is Format's
// one line per scope, which scripts and /healthz share.
func (statusRow) TableHeader() []string { return []string{"Name", "Level", "Message", "Error"} }

// TableRow is one scope's row.
func (r statusRow) TableRow() []string { return []string{r.Name, r.Level, r.Message, r.Error} }

func rowOf(st Status) statusRow {
	r := statusRow{Name: st.Name, Level: string(st.Level), Message: st.Message, Error: st.Error, External: st.External}
	if !st.Updated.IsZero() {
		r.Updated = &st.Updated
	}
	return r
}

func healthCmd(p *Provider) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "Show every module's health: level, message and error",
			Detail: []string{
				"Prints one line per health scope (modules and their jobs),",
				"parents first, or a list of objects with -o json or yaml. The",
				"level of a scope includes the scopes below it. Fails when a",
				"scope is not OK, so that scripts can wait for health with",
				"'* health' or expect '! health'. This is readiness, as on",
				"/readyz: a scope Degraded for a cause outside the agent",
				"(cause=external) fails it too, though not /healthz.",
			},
			Flags: shellfmt.AddFlag,
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			format, err := shellfmt.NoArgsFormat(s, args)
			if err != nil {
				return nil, err
			}
			all := p.All()
			ok, bad := p.Healthy()
			out := Format(all)
			if format != shellfmt.Table {
				rows := make([]statusRow, len(all))
				for i, st := range all {
					rows[i] = rowOf(st)
				}
				if out, err = shellfmt.Render(format, rows); err != nil {
					return nil, err
				}
			}
			return func(*script.State) (string, string, error) {
				if !ok {
					return out, "", fmt.Errorf("%d health scopes not OK: %s", len(bad), strings.TrimSpace(Format(bad[:1])))
				}
				return out, "", nil
			}, nil
		},
	)
}
