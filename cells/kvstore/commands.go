package kvstore

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/cilium/hive"
	"github.com/cilium/hive/script"

	"github.com/identityd/identityd/internal/shellfmt"
)

func scriptCommands(c *Client) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"kvstore/status": statusCmd(c),
	})
}

// errNoClient is kvstore/status's answer in a hive whose kvstore cell made
// no client.
var errNoClient = errors.New("no etcd client: --identity-allocation-mode=crd without --kvstore-endpoints")

func statusCmd(c *Client) script.Cmd {
	return shellfmt.StatusCommand(
		script.CmdUsage{
			Summary: "Show the etcd connection: mode, endpoints, leader, revision, lease, last error",
			Detail: []string{
				"Asks every endpoint for its status (2s timeout each) and prints",
				"a summary followed by one row per endpoint. With -o json or",
				"yaml, prints the same as one object with its endpoints.",
			},
		},
		c, (*Client).Status, FormatStatus, viewOf, errNoClient)
}

// statusView is Status as kvstore/status prints it with -o json or yaml:
// the same fields as the table, with the same kebab-case names as the
// other commands' objects. Status itself has no JSON tags because it is Go
// API, not a format.
type statusView struct {
	Mode      string         `json:"mode"`
	Node      string         `json:"node"`
	Connected int            `json:"connected"`
	Leader    string         `json:"leader,omitempty"`
	Revision  int64          `json:"revision"`
	Lease     string         `json:"lease,omitempty"`
	LeaseTTL  string         `json:"lease-ttl"`
	LastError string         `json:"last-error,omitempty"`
	Endpoints []endpointView `json:"endpoints"`
}

type endpointView struct {
	Endpoint  string `json:"endpoint"`
	Connected bool   `json:"connected"`
	Member    string `json:"member,omitempty"`
	Leader    bool   `json:"leader"`
	Version   string `json:"version,omitempty"`
	Revision  int64  `json:"revision,omitempty"`
	DBSize    int64  `json:"db-size,omitempty"`
	Error     string `json:"error,omitempty"`
}

func viewOf(st Status) statusView {
	v := statusView{
		Mode: st.Mode(), Node: st.NodeName, Connected: st.Connected(), Leader: st.Leader,
		Revision: st.Revision, LeaseTTL: st.LeaseTTL.String(), LastError: st.LastError,
		Endpoints: make([]endpointView, len(st.Endpoints)),
	}
	if st.LeaseID != 0 {
		// Hexadecimal, as etcdctl prints lease IDs.
		v.Lease = fmt.Sprintf("%x", int64(st.LeaseID))
	}
	for i, ep := range st.Endpoints {
		e := endpointView{Endpoint: ep.Endpoint, Connected: ep.Connected, Leader: ep.IsLeader, Version: ep.Version, Error: ep.Error}
		if ep.Connected {
			e.Member, e.Revision, e.DBSize = fmt.Sprintf("%x", ep.MemberID), ep.Revision, ep.DBSize
		}
		v.Endpoints[i] = e
	}
	return v
}

// TableHeader lets the shell render statusView; kvstore/status prints
// FormatStatus as its table, not these columns.
func (statusView) TableHeader() []string {
	return []string{"Mode", "Node", "Connected", "Leader", "Revision", "Lease"}
}

// TableRow is the status's values in the order of TableHeader.
func (v statusView) TableRow() []string {
	return []string{v.Mode, v.Node, fmt.Sprintf("%d/%d", v.Connected, len(v.Endpoints)), v.Leader,
		strconv.FormatInt(v.Revision, 10), v.Lease}
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
