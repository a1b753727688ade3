package kvstore

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/script"
)

func scriptCommands(c *Client) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"kvstore/status": statusCmd(c),
	})
}

func statusCmd(c *Client) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "Show the etcd connection: mode, endpoints, leader, revision, lease, last error",
			Detail: []string{
				"Asks every endpoint for its status (2s timeout each) and prints",
				"a summary followed by one row per endpoint.",
			},
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) > 0 {
				return nil, script.ErrUsage
			}
			ctx, cancel := context.WithTimeout(s.Context(), 10*time.Second)
			defer cancel()
			out := FormatStatus(c.Status(ctx))
			return func(*script.State) (string, string, error) { return out, "", nil }, nil
		},
	)
}

// FormatStatus renders st as the tables kvstore/status prints.
func FormatStatus(st Status) string {
	var b strings.Builder
	w := tabwriter.NewWriter(&b, 0, 4, 2, ' ', 0)
	lease := "none"
	if st.LeaseID != 0 {
		lease = fmt.Sprintf("%x", int64(st.LeaseID))
	}
	orNone := func(s string) string {
		if s == "" {
			return "none"
		}
		return s
	}
	fmt.Fprintf(w, "Mode\t%s\n", st.Mode())
	fmt.Fprintf(w, "Node\t%s\n", st.NodeName)
	fmt.Fprintf(w, "Connected\t%d/%d\n", st.Connected(), len(st.Endpoints))
	fmt.Fprintf(w, "Leader\t%s\n", orNone(st.Leader))
	fmt.Fprintf(w, "Revision\t%d\n", st.Revision)
	fmt.Fprintf(w, "Lease\t%s\n", lease)
	fmt.Fprintf(w, "Lease TTL\t%s\n", st.LeaseTTL)
	fmt.Fprintf(w, "Last error\t%s\n", orNone(st.LastError))
	w.Flush()
	b.WriteString("\n")

	w = tabwriter.NewWriter(&b, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "Endpoint\tConnected\tMember\tLeader\tVersion\tRevision\tDB size\tError")
	for _, ep := range st.Endpoints {
		member, rev, size := "", "", ""
		if ep.Connected {
			member = fmt.Sprintf("%x", ep.MemberID)
			rev = strconv.FormatInt(ep.Revision, 10)
			size = strconv.FormatInt(ep.DBSize, 10)
		}
		fmt.Fprintf(w, "%s\t%t\t%s\t%t\t%s\t%s\t%s\t%s\n",
			ep.Endpoint, ep.Connected, member, ep.IsLeader, ep.Version, rev, size, ep.Error)
	}
	w.Flush()
	return b.String()
}
