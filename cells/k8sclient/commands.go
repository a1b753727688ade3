package k8sclient

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

// errNotConfigured is k8s/status's answer on a node that needs no
// Kubernetes client.
var errNotConfigured = errors.New("no Kubernetes API server is used: the identity allocation mode is not crd and neither --k8s-kubeconfig-path nor --k8s-api-server is set")

func scriptCommands(c *Client) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"k8s/status": statusCmd(c),
	})
}

func statusCmd(c *Client) script.Cmd {
	return shellfmt.StatusCommand(
		script.CmdUsage{
			Summary: "Show the Kubernetes API server connection: server, settings, version, last error",
			Detail: []string{
				"Asks the API server for /version (5s timeout) and prints the",
				"server, where its settings came from, the client-side rate",
				"limit, the server's version and the last request error. With",
				"-o json or yaml, prints the same as one object.",
			},
		},
		c, (*Client).Status, FormatStatus, viewOf, errNotConfigured)
}

// statusView is Status as k8s/status prints it with -o json or yaml, with
// the kebab-case names of the other commands' objects.
type statusView struct {
	Server         string  `json:"server"`
	Source         string  `json:"source"`
	Connected      bool    `json:"connected"`
	Version        string  `json:"version,omitempty"`
	QPS            float64 `json:"qps"`
	Burst          int     `json:"burst"`
	RequestTimeout string  `json:"request-timeout"`
	Error          string  `json:"error,omitempty"`
	LastError      string  `json:"last-error,omitempty"`
}

func viewOf(st Status) statusView {
	return statusView{
		Server: st.Server, Source: st.Source, Connected: st.Connected, Version: st.Version,
		QPS: st.QPS, Burst: st.Burst, RequestTimeout: st.RequestTimeout.String(),
		Error: st.Error, LastError: st.LastError,
	}
}

// TableHeader lets the shell render statusView; k8s/status prints
// FormatStatus as its table, not these columns.
func (statusView) TableHeader() []string {
	return []string{"Server", "Connected", "Version", "QPS", "Burst"}
}

// TableRow is the status's values in the order of TableHeader.
func (v statusView) TableRow() []string {
	return []string{v.Server, strconv.FormatBool(v.Connected), v.Version,
		strconv.FormatFloat(v.QPS, 'g', -1, 64), strconv.Itoa(v.Burst)}
}

// FormatStatus renders st as the table k8s/status prints.
func FormatStatus(st Status) string {
	var b strings.Builder
	w := tabwriter.NewWriter(&b, 0, 4, 2, ' ', 0)
	orNone := func(s string) string {
		if s == "" {
			return "none"
		}
		return s
	}
	limit := "none"
	if st.QPS > 0 {
		limit = fmt.Sprintf("%g/s, burst %d", st.QPS, st.Burst)
	}
	fmt.Fprintf(w, "Server\t%s\n", st.Server)
	fmt.Fprintf(w, "Config\t%s\n", st.Source)
	fmt.Fprintf(w, "Connected\t%t\n", st.Connected)
	fmt.Fprintf(w, "Version\t%s\n", orNone(st.Version))
	fmt.Fprintf(w, "Rate limit\t%s\n", limit)
	fmt.Fprintf(w, "Request timeout\t%s\n", st.RequestTimeout)
	fmt.Fprintf(w, "Error\t%s\n", orNone(st.Error))
	fmt.Fprintf(w, "Last error\t%s\n", orNone(st.LastError))
	w.Flush()
	return b.String()
}
