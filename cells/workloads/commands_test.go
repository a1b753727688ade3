package workloads

import (
	"bufio"
	"encoding/json"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive/script"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// runList runs one workloads/list command line on w and returns its
// stdout or its error.
func runList(t *testing.T, w *Workloads, line string) (string, error) {
	t.Helper()
	e := &script.Engine{Cmds: map[string]script.Cmd{"workloads/list": listCmd(w)}}
	s, err := script.NewState(t.Context(), t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	var log strings.Builder
	err = e.Execute(s, "", bufio.NewReader(strings.NewReader(line+"\n")), &log)
	return s.Stdout(), err
}

func TestListCommand(t *testing.T) {
	w := newWorkloads(nil, DefaultConfig, nil, "n1", "c1", nil, nil, newWorkloadMetrics())
	web := labels.MustParse("k8s:app=web", "k8s:io.kubernetes.pod.namespace=shop")
	w.pods["shop/web-1"] = &podState{
		want: want{labels: web}, held: &identity.Identity{ID: 70000, Labels: web}, heldLabels: web,
		prefixes: []netip.Prefix{netip.MustParsePrefix("10.0.0.1/32"), netip.MustParsePrefix("fd00::1/128")},
	}
	w.pods["shop/web-2"] = &podState{want: want{labels: web}, failures: 3, waitingSince: time.Unix(1, 0)}
	w.pods["kube-system/agent"] = &podState{want: want{skip: reasonHostNetwork}}

	out, err := runList(t, w, "workloads/list")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"kube-system/agent", "host network", "shop/web-1", "10.0.0.1/32,fd00::1/128", "70000", "ready", "allocation failed 3 times", "k8s:app=web"} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}

	out, err = runList(t, w, "workloads/list shop -o json")
	if err != nil {
		t.Fatal(err)
	}
	var pods []Pod
	if err := json.Unmarshal([]byte(out), &pods); err != nil {
		t.Fatalf("-o json: %v\n%s", err, out)
	}
	if len(pods) != 2 || pods[0].Name != "shop/web-1" || pods[0].Identity != 70000 || len(pods[0].IPs) != 2 || pods[1].Identity != 0 {
		t.Fatalf("workloads/list shop: %+v", pods)
	}
	if out, err := runList(t, w, "workloads/list sho"); err != nil || strings.Contains(out, "shop/") {
		t.Fatalf("a namespace that is a prefix of another: %v\n%s", err, out)
	}

	// Hostile arguments: a clear error each, nothing listed.
	for _, tc := range []struct{ line, want string }{
		{"workloads/list shop other", "at most one namespace"},
		{"workloads/list Shop_1", "not a namespace name"},
		{"workloads/list ../etc", "not a namespace name"},
		{"workloads/list " + strings.Repeat("a", 300), "not a namespace name"},
		{"workloads/list 'shop\x01'", "not a namespace name"},
		{"workloads/list -o xml", "unknown output format"},
		{"workloads/list --bogus", "unknown flag"},
	} {
		out, err := runList(t, w, tc.line)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: %v, want an error with %q", tc.line, err, tc.want)
		}
		if out != "" {
			t.Errorf("%q printed %q", tc.line, out)
		}
	}

	// A node without the Kubernetes client says why it lists nothing.
	if _, err := runList(t, nil, "workloads/list"); err == nil || !strings.Contains(err.Error(), "no Kubernetes API server") {
		t.Fatalf("without the client: %v", err)
	}
}
