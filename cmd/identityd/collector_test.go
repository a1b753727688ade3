package main

import (
	"bufio"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/internal/etcdtest"
)

// metricValue reads the value of the series named exactly series (name
// and labels as /metrics prints them) from the agent's /metrics; ok is
// false when the series is missing or /metrics does not answer.
func (a *healthAgent) metricValue(series string) (float64, bool) {
	code, body := a.probe("/metrics")
	if code != http.StatusOK {
		return 0, false
	}
	sc := bufio.NewScanner(strings.NewReader(body))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		name, value, ok := strings.Cut(sc.Text(), " ")
		if ok && name == series {
			v, err := strconv.ParseFloat(value, 64)
			return v, err == nil
		}
	}
	return 0, false
}

// TestEtcdCollectorKilled runs three agents on one external etcd with a
// short GC interval: exactly one collects (identityd_identity_gc_leader,
// and only its GC runs count up). The collector is killed with SIGKILL:
// another node takes over once the killed node's lease ended (one lease
// TTL), and its next runs delete the master key only the killed node
// referenced and keep the one a live node references.
func TestEtcdCollectorKilled(t *testing.T) {
	waitingParallel(t)
	if testing.Short() {
		t.Skip("runs etcd and three agent processes for about a minute")
	}
	const leaseTTL = 25 * time.Second
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	cli := etcd.Client(t)
	names := []string{"node-a", "node-b", "node-c"}
	agents := map[string]*healthAgent{}
	for _, name := range names {
		agents[name] = startHealthAgent(t, "--kvstore-endpoints", strings.Join(etcd.Endpoints(), ","),
			"--node-name", name, "--kvstore-lease-ttl", leaseTTL.String(),
			"--identity-gc-interval", "1s", "--identity-restore-grace-period", "1s")
	}
	for _, name := range names {
		agents[name].waitFor("/readyz", http.StatusOK, 90*time.Second)
	}
	const (
		leaderSeries = "identityd_identity_gc_leader"
		runsSeries   = `identityd_identity_gc_runs{outcome="success"}`
	)
	collectors := func(among []string) []string {
		var out []string
		for _, name := range among {
			if v, _ := agents[name].metricValue(leaderSeries); v == 1 {
				out = append(out, name)
			}
		}
		return out
	}
	var leader string
	waitUntil(t, 30*time.Second, "exactly one node collects", func() error {
		if c := collectors(names); len(c) != 1 {
			return fmt.Errorf("collectors %v", c)
		}
		leader = collectors(names)[0]
		return nil
	})
	var others []string
	for _, name := range names {
		if name != leader {
			others = append(others, name)
		}
	}
	// Only the collector runs the GC.
	waitUntil(t, 30*time.Second, "the collector's GC runs", func() error {
		if v, _ := agents[leader].metricValue(runsSeries); v < 3 {
			return fmt.Errorf("%s ran the GC %v times", leader, v)
		}
		return nil
	})
	for _, name := range others {
		if v, ok := agents[name].metricValue(runsSeries); !ok || v != 0 {
			t.Errorf("%s, not the collector, ran the GC %v times (series found: %v)", name, v, ok)
		}
	}

	shL, shM := agents[leader].dial(), agents[others[0]].dial()
	defer shM.Close()
	onlyLeader := allocate(t, shL, "k8s:app=only-collector")
	shared := allocate(t, shM, "k8s:app=shared")
	if got := allocate(t, shL, "k8s:app=shared"); got != shared {
		t.Fatalf("%s got %d for the label set %s holds as %d", leader, got, others[0], shared)
	}
	shL.Close()
	agents[leader].stop(syscall.SIGKILL)
	killed := time.Now()

	var next string
	waitUntil(t, leaseTTL+20*time.Second, "another node collects", func() error {
		c := collectors(others)
		if len(c) != 1 {
			return fmt.Errorf("collectors %v", c)
		}
		next = c[0]
		return nil
	})
	took := time.Since(killed)
	t.Logf("%s collects %s after %s was killed", next, took.Round(100*time.Millisecond), leader)
	if took > leaseTTL+10*time.Second {
		t.Errorf("takeover took %s, want within the lease TTL %s (and a few seconds)", took, leaseTTL)
	}
	waitUntil(t, 30*time.Second, "the new collector deletes the master key only the killed node referenced", func() error {
		resp, err := cli.Get(t.Context(), etcdstore.MasterKeyPrefix+strconv.Itoa(onlyLeader))
		if err != nil {
			return err
		}
		if len(resp.Kvs) != 0 {
			return fmt.Errorf("master key of %d still exists", onlyLeader)
		}
		return nil
	})
	// Two more runs of the new collector keep what a live node uses.
	runs, _ := agents[next].metricValue(runsSeries)
	waitUntil(t, 30*time.Second, "two more GC runs", func() error {
		if v, _ := agents[next].metricValue(runsSeries); v < runs+2 {
			return fmt.Errorf("%v runs", v)
		}
		return nil
	})
	resp, err := cli.Get(t.Context(), etcdstore.MasterKeyPrefix+strconv.Itoa(shared))
	if err != nil || len(resp.Kvs) != 1 {
		t.Errorf("master key of %d, which %s references, is gone: %v %v", shared, others[0], resp, err)
	}
	if c := collectors(others); len(c) != 1 {
		t.Errorf("collectors after the takeover: %v", c)
	}
}
