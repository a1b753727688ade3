package restarttest

import (
	"fmt"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/identityd/identityd/cells/shell"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/ipcachemaptest"
	"github.com/identityd/identityd/internal/robustness"
)

// Sizes of TestDurableAnswerRestart.
const (
	// durableBurst is the number of upserts of the burst the agent is
	// killed after, durableConns the shell connections they share.
	durableBurst = 1000
	durableConns = 8
	// durableSequential is the number of upserts of each sequential
	// series, which measure the latency that waiting adds.
	durableSequential = 200
	// durableAfter is the number of prefixes upserted after the restart,
	// which must not get any number answered before.
	durableAfter = 100
)

// TestDurableAnswerRestart runs the binary, answers ipcache/upsert calls in
// their default (waiting) form through the shell socket, SIGKILLs the agent
// right after the last answer and starts it again on the same state
// directory: every answered prefix -> identity pair must be in the restarted
// agent's table and datapath map with the same number, and prefixes
// upserted after the restart must get numbers nobody was answered before.
// The checkpoint interval is an hour, so only the durability point can have
// put the burst's identities on disk. It runs with the file backend, and
// with a pinned BPF map as root.
//
// The nowait cases run the same calls with --no-wait: after SIGKILL they
// only report what the kill cost (such answers may be lost); after SIGTERM
// no pair may be lost. A sequential series before each burst measures the
// latency of one caller.
func TestDurableAnswerRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	bin := agentBinary(t)
	backends := []struct {
		name  string
		flags func(t *testing.T) []string
	}{
		{"file", func(*testing.T) []string { return []string{"--ipcache-map=file"} }},
		{"bpf", func(t *testing.T) []string {
			return []string{"--ipcache-map=bpf", "--ipcache-map-pin-path=" + ipcachemaptest.PinPath(t, "durable-test")}
		}},
	}
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) { testDurableAnswer(t, bin, b.flags(t), true, syscall.SIGKILL) })
		t.Run(b.name+"-nowait", func(t *testing.T) { testDurableAnswer(t, bin, b.flags(t), false, syscall.SIGKILL) })
		t.Run(b.name+"-nowait-sigterm", func(t *testing.T) { testDurableAnswer(t, bin, b.flags(t), false, syscall.SIGTERM) })
	}
}

// durablePrefix is the i-th prefix of a series.
func durablePrefix(series, i int) netip.Prefix {
	return netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(series), byte(i >> 8), byte(i)}), 32)
}

// answerRow is what the test reads of an ipcache row printed with -o json.
type answerRow struct {
	Prefix   netip.Prefix             `json:"prefix"`
	Identity identity.NumericIdentity `json:"identity"`
}

func parseRows(out string) ([]answerRow, error) { return robustness.DecodeList[answerRow](out) }

// upserter runs ipcache/upsert calls on one shell connection.
type upserter struct {
	sh   *robustness.Shell
	wait bool
}

func dialUpserter(t *testing.T, dir string, wait bool) *upserter {
	t.Helper()
	sh, err := robustness.DialShell(filepath.Join(dir, shell.SocketName), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sh.Close() })
	return &upserter{sh: sh, wait: wait}
}

// upsert upserts one prefix and returns the identity it was answered.
func (u *upserter) upsert(p netip.Prefix) (identity.NumericIdentity, time.Duration, error) {
	args := []string{"ipcache/upsert", "-o", "json", p.String()}
	if !u.wait {
		args = []string{"ipcache/upsert", "--no-wait", "-o", "json", p.String()}
	}
	line := strings.Join(args, " ")
	t0 := time.Now()
	out, err := u.sh.Run(t0.Add(time.Minute), args...)
	d := time.Since(t0)
	if err != nil {
		return 0, d, fmt.Errorf("%s: %w", line, err)
	}
	rows, err := parseRows(out)
	if err != nil {
		return 0, d, err
	}
	if len(rows) != 1 || rows[0].Prefix != p || rows[0].Identity == 0 {
		return 0, d, fmt.Errorf("%s: answered %+v", line, rows)
	}
	return rows[0].Identity, d, nil
}

// latencies summarizes call durations.
func latencies(ds []time.Duration) string {
	s := slices.Clone(ds)
	slices.Sort(s)
	var sum time.Duration
	for _, d := range s {
		sum += d
	}
	q := func(f float64) time.Duration { return s[min(len(s)-1, int(f*float64(len(s))))] }
	return fmt.Sprintf("mean %v p50 %v p99 %v max %v",
		(sum / time.Duration(len(s))).Round(time.Microsecond), q(0.5).Round(time.Microsecond),
		q(0.99).Round(time.Microsecond), s[len(s)-1].Round(time.Microsecond))
}

// testDurableAnswer answers upserts, waiting or not, stops the agent with
// sig right after the last answer and checks the pairs after a restart:
// none may be lost if the answers were waited for or the stop was SIGTERM.
func testDurableAnswer(t *testing.T, bin string, flags []string, wait bool, sig syscall.Signal) {
	dir := t.TempDir()
	p := startProc(t, bin, dir, flags...)
	answered := map[netip.Prefix]identity.NumericIdentity{}

	// A sequential series first, to measure what waiting costs one
	// caller; its pairs are checked too.
	u := dialUpserter(t, dir, wait)
	var seq []time.Duration
	for i := range durableSequential {
		pfx := durablePrefix(100, i)
		id, d, err := u.upsert(pfx)
		if err != nil {
			t.Fatal(err)
		}
		seq = append(seq, d)
		answered[pfx] = id
	}
	t.Logf("sequential, wait=%v: %d upserts on one connection: %s", wait, durableSequential, latencies(seq))

	// The burst: every connection upserts its share as fast as it is
	// answered.
	var (
		mu   sync.Mutex
		ds   []time.Duration
		errs []error
		wg   sync.WaitGroup
	)
	conns := make([]*upserter, durableConns)
	for c := range conns {
		conns[c] = dialUpserter(t, dir, wait)
	}
	t0 := time.Now()
	for c, u := range conns {
		wg.Go(func() {
			for i := c; i < durableBurst; i += durableConns {
				pfx := durablePrefix(1+i>>16, i&0xffff)
				id, d, err := u.upsert(pfx)
				mu.Lock()
				if err != nil {
					errs = append(errs, err)
				} else {
					answered[pfx] = id
					ds = append(ds, d)
				}
				mu.Unlock()
				if err != nil {
					return
				}
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(t0)
	// Stopped right after the last answer: after SIGKILL, nothing the
	// agent does after answering can help.
	if err := p.cmd.Process.Signal(sig); err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Wait(); sig == syscall.SIGTERM && err != nil {
		t.Fatalf("agent exited with %s after SIGTERM\nlog:\n%s", err, p.log)
	}
	if len(errs) > 0 {
		t.Fatalf("%d upserts failed, first: %v", len(errs), errs[0])
	}
	t.Logf("burst, wait=%v: %d upserts on %d connections in %v (%.0f/s): %s",
		wait, durableBurst, durableConns, elapsed.Round(time.Millisecond),
		float64(durableBurst)/elapsed.Seconds(), latencies(ds))

	q := startProc(t, bin, dir, flags...)
	table := q.tablePairs()
	inMap := q.mapDump()
	holder := map[identity.NumericIdentity]netip.Prefix{}
	for pfx, id := range answered {
		holder[id] = pfx
	}

	// Prefixes upserted after the restart must get numbers of their own.
	u = dialUpserter(t, q.dir, true)
	after := map[netip.Prefix]identity.NumericIdentity{}
	for i := range durableAfter {
		pfx := durablePrefix(200, i)
		id, _, err := u.upsert(pfx)
		if err != nil {
			t.Fatal(err)
		}
		after[pfx] = id
	}

	var lost, renumbered []string
	for pfx, id := range answered {
		if table[pfx] != id || inMap[pfx] != id {
			lost = append(lost, fmt.Sprintf("%s: answered %d, table %d, map %d", pfx, id, table[pfx], inMap[pfx]))
		}
	}
	for _, m := range []map[netip.Prefix]identity.NumericIdentity{table, inMap, after} {
		for pfx, id := range m {
			if h, ok := holder[id]; ok && h != pfx {
				renumbered = append(renumbered, fmt.Sprintf("%d: answered for %s, now held by %s", id, h, pfx))
			}
		}
	}
	slices.Sort(lost)
	slices.Sort(renumbered)
	renumbered = slices.Compact(renumbered)
	t.Logf("wait=%v: after %s and restart, %d of %d answered pairs lost, %d numbers given to another prefix",
		wait, sig, len(lost), len(answered), len(renumbered))
	if (wait || sig == syscall.SIGTERM) && (len(lost) > 0 || len(renumbered) > 0) {
		t.Errorf("answered pairs lost (%d), first: %v\nnumbers given to another prefix (%d), first: %v\nstatus: %s",
			len(lost), lost[:min(5, len(lost))], len(renumbered), renumbered[:min(5, len(renumbered))],
			q.mustShell("identity/restore-status", "-o", "json"))
	}
	q.stop(syscall.SIGTERM)
}
