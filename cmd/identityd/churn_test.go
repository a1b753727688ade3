package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/metadata"

	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/cells/shell"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/allocatortest"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/k8stest"
	"github.com/identityd/identityd/internal/robustness"
	"github.com/identityd/identityd/labels"
)

// TestChurnLevelsOffProcess is the stores' TestChurnLevelsOff against two
// identityd agent processes per store, as users run them: subtest crd on a
// real API server, without Cilium agents and with the shortest heartbeat
// timeout crd mode accepts (2m), and subtest etcd on one real etcd. Each
// node allocates the same IDENTITYD_CHURN_RATE new label sets a second
// (default 40) through its agent's shell, holds each 10 s and releases it
// there, for IDENTITYD_CHURN_SECONDS (it runs only when that is set; 300
// for the full run); the agents collect every IDENTITYD_CHURN_GC_INTERVAL
// seconds (default 10) at IDENTITYD_CHURN_GC_LIMIT deletions a minute
// (default 2500). The identities are counted at the server and the
// deletions read from the agents' /metrics: the number of identities
// levels off, growing less than 1/s over the last 100 s, and the
// collectors delete at least 95% of the new label sets the run delivered
// there (docs/benchmarks.md, "Identity churn").
func TestChurnLevelsOffProcess(t *testing.T) {
	c := allocatortest.ChurnFromEnv(t)
	gc := []string{"--identity-gc-interval", c.Interval.String(),
		"--identity-gc-rate-limit", strconv.Itoa(c.Limit), "--identity-gc-rate-interval", time.Minute.String()}
	t.Run("crd", func(t *testing.T) {
		srv := k8stest.Start(t)
		meta, err := metadata.NewForConfig(srv.RESTConfig())
		if err != nil {
			t.Fatal(err)
		}
		extra := append([]string{"--identity-heartbeat-timeout", c.HeartbeatTimeout.String(),
			"--identity-gc-cilium-agents=false"}, gc...)
		var agents []*healthAgent
		for _, node := range []string{"node-a", "node-b"} {
			agents = append(agents, startCRDAgent(t, filepath.Join(t.TempDir(), node), srv.Kubeconfig(), node, extra...))
		}
		runProcessChurn(t, c, agents, func(ctx context.Context) (int, error) {
			return countCiliumIdentities(ctx, meta)
		}, `identityd_crd_identity_gc_entries{status="deleted"}`, `identityd_crd_identity_gc_entries{status="reclaimed"}`)
	})
	t.Run("etcd", func(t *testing.T) {
		etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
		cli := etcd.Client(t)
		var agents []*healthAgent
		for _, node := range []string{"node-a", "node-b"} {
			a := startHealthAgent(t, append([]string{"--kvstore-endpoints", strings.Join(etcd.Endpoints(), ","),
				"--node-name", node}, gc...)...)
			agents = append(agents, a)
		}
		for _, a := range agents {
			a.waitFor("/readyz", http.StatusOK, 90*time.Second)
		}
		runProcessChurn(t, c, agents, func(ctx context.Context) (int, error) {
			resp, err := cli.Get(ctx, etcdstore.MasterKeyPrefix, clientv3.WithPrefix(), clientv3.WithKeysOnly(), clientv3.WithCountOnly())
			if err != nil {
				return 0, err
			}
			return int(resp.Count), nil
		}, `identityd_identity_gc_entries{status="deleted"}`)
	})
}

// churnConns is the number of shell connections each node allocates
// over: a connection runs one command at a time, and RunChurn keeps up to
// 16 allocations of a node in flight.
const churnConns = 16

// runProcessChurn runs c on the agents through their shells; count reads
// the global identities at the server, and the deletions are the sum over
// the agents of the deleted series of their /metrics. A failed reading
// fails the test and keeps the last one, so that the run goes on.
func runProcessChurn(t *testing.T, c allocatortest.Churn, agents []*healthAgent, count func(context.Context) (int, error), deleted ...string) {
	t.Helper()
	var nodes []allocatortest.ChurnNode
	for _, a := range agents {
		nodes = append(nodes, newShellChurnNode(t, a))
	}
	var identities, deletions int
	allocatortest.RunChurn(t, c, nodes, func() (int, int) {
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		defer cancel()
		if n, err := count(ctx); err != nil {
			t.Errorf("counting the identities at the server: %v", err)
		} else {
			identities = n
		}
		sum := 0.0
		for _, a := range agents {
			v, err := scrapeSum(a, deleted...)
			if err != nil {
				t.Errorf("%s: %v", a.dir, err)
				return identities, deletions
			}
			sum += v
		}
		deletions = int(sum)
		return identities, deletions
	})
}

// newShellChurnNode allocates through churnConns connections to a's
// shell and releases through one more. A connection whose command broke
// off (not one that failed) is closed and dialled again on its next use.
func newShellChurnNode(t *testing.T, a *healthAgent) allocatortest.ChurnNode {
	socket := filepath.Join(a.dir, shell.SocketName)
	conns := make(chan *robustness.Shell, churnConns)
	for range churnConns {
		conns <- a.dial()
	}
	rel := a.dial()
	// RunChurn releases a node's sets one at a time; ChurnNode does not
	// promise it.
	var relMu sync.Mutex
	t.Cleanup(func() {
		close(conns)
		for sh := range conns {
			if sh != nil {
				sh.Close()
			}
		}
		rel.Close()
	})
	var logged sync.Once
	logFirst := func(err error) {
		logged.Do(func() { t.Logf("%s: first failure: %v", a.dir, err) })
	}
	// run runs a command on *sh, dialling first when *sh is nil.
	run := func(sh **robustness.Shell, args ...string) (string, error) {
		if *sh == nil {
			s, err := robustness.DialShell(socket, 10*time.Second)
			if err != nil {
				return "", err
			}
			*sh = s
		}
		out, err := (*sh).Run(time.Now().Add(time.Minute), args...)
		if err != nil && !errors.As(err, new(*robustness.CommandError)) {
			(*sh).Close()
			*sh = nil
		}
		return out, err
	}
	return func(ctx context.Context, lbls labels.Labels) (func(), error) {
		args := []string{"identity/allocate", "-o", "json"}
		for _, l := range lbls {
			args = append(args, l.String())
		}
		sh := <-conns
		out, err := run(&sh, args...)
		conns <- sh
		if err != nil {
			logFirst(fmt.Errorf("identity/allocate %v: %w", lbls, err))
			return nil, err
		}
		m := idField.FindStringSubmatch(out)
		if m == nil {
			err := fmt.Errorf("identity/allocate %v: no id in %q", lbls, out)
			logFirst(err)
			return nil, err
		}
		return func() {
			relMu.Lock()
			defer relMu.Unlock()
			if out, err := run(&rel, "identity/release", m[1]); err != nil {
				t.Errorf("%s: identity/release %s: %v %s", a.dir, m[1], err, out)
			}
		}, nil
	}
}

// countCiliumIdentities counts the CiliumIdentity objects of the
// cluster's range (cluster 0's) with a paged, metadata-only LIST.
func countCiliumIdentities(ctx context.Context, meta metadata.Interface) (int, error) {
	var cluster identity.ClusterInfo
	n := 0
	opts := metav1.ListOptions{Limit: 1000}
	for {
		list, err := meta.Resource(crdstore.CiliumIdentityResource).List(ctx, opts)
		if err != nil {
			return 0, err
		}
		for _, obj := range list.Items {
			id, err := identity.ParseNumericIdentity(obj.Name)
			if err == nil && id >= cluster.MinID() && id <= cluster.MaxID() {
				n++
			}
		}
		if list.Continue == "" {
			return n, nil
		}
		opts.Continue = list.Continue
	}
}

// scrapeSum returns the sum of the series named exactly series (name and
// labels as /metrics prints them) of one reading of a's /metrics; every
// series must be there.
func scrapeSum(a *healthAgent, series ...string) (float64, error) {
	var code int
	var body string
	for range 3 {
		if code, body = a.probe("/metrics"); code == http.StatusOK {
			break
		}
	}
	if code != http.StatusOK {
		return 0, fmt.Errorf("/metrics answered %d: %.200s", code, body)
	}
	want := map[string]bool{}
	for _, s := range series {
		want[s] = true
	}
	sum := 0.0
	found := 0
	sc := bufio.NewScanner(strings.NewReader(body))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		name, value, ok := strings.Cut(sc.Text(), " ")
		if !ok || !want[name] {
			continue
		}
		v, err := strconv.ParseFloat(value, 64)
		if err != nil {
			return 0, fmt.Errorf("/metrics: %s: %w", sc.Text(), err)
		}
		sum += v
		found++
		delete(want, name)
	}
	if found != len(series) {
		return 0, fmt.Errorf("/metrics has none of %v", want)
	}
	return sum, nil
}
