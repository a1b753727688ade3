package restarttest

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/identityd/identityd/cells/checkpoint"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/ipcachemap"
	"github.com/identityd/identityd/internal/ipcachemaptest"
	"github.com/identityd/identityd/internal/journal"
	"github.com/identityd/identityd/internal/robustness"
	"github.com/identityd/identityd/internal/testproc"
)

// journalBackends are the datapath map backends of the journal's process
// tests: the file backend, whose map file has a journal, and a pinned BPF
// map as root, where the kernel holds the map and only the identities go
// through the journal.
func journalBackends() []struct {
	name  string
	flags func(t *testing.T) []string
} {
	return []struct {
		name  string
		flags func(t *testing.T) []string
	}{
		{"file", func(*testing.T) []string { return []string{"--ipcache-map=file"} }},
		{"bpf", func(t *testing.T) []string {
			return []string{"--ipcache-map=bpf", "--ipcache-map-pin-path=" + ipcachemaptest.PinPath(t, "journal-test")}
		}},
	}
}

// TestDurableDeleteKill upserts 50 prefixes, deletes them with the waiting
// ipcache/delete, SIGKILLs the agent right after the last answer and
// starts it again: none of the deleted prefixes may come back, in the
// table or the datapath map, on either backend.
func TestDurableDeleteKill(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	bin := agentBinary(t)
	for _, b := range journalBackends() {
		t.Run(b.name, func(t *testing.T) {
			flags := b.flags(t)
			dir := t.TempDir()
			p := startProc(t, bin, dir, flags...)
			u := dialUpserter(t, dir, true)
			const n = 50
			var prefixes []netip.Prefix
			for i := range n {
				pfx := durablePrefix(60, i)
				if _, _, err := u.upsert(pfx); err != nil {
					t.Fatal(err)
				}
				prefixes = append(prefixes, pfx)
			}
			for _, pfx := range prefixes {
				if _, err := u.sh.Run(time.Now().Add(time.Minute), "ipcache/delete", pfx.String()); err != nil {
					t.Fatalf("ipcache/delete %s: %v", pfx, err)
				}
			}
			p.stop(syscall.SIGKILL)

			q := startProc(t, bin, dir, flags...)
			rows, err := parseRows(q.mustShell("ipcache/list", "-o", "json"))
			if err != nil {
				t.Fatal(err)
			}
			inMap := q.mapDump()
			var back []string
			came := 0
			for _, pfx := range prefixes {
				was := len(back)
				for _, r := range rows {
					if r.Prefix == pfx {
						back = append(back, pfx.String()+" in the table")
					}
				}
				if _, ok := inMap[pfx]; ok {
					back = append(back, pfx.String()+" in the map")
				}
				if len(back) > was {
					came++
				}
			}
			t.Logf("%s: after %d waited deletes and SIGKILL, %d deleted prefixes came back", b.name, n, came)
			if len(back) > 0 {
				t.Fatalf("deleted prefixes came back: %v", back)
			}
			q.stop(syscall.SIGTERM)
		})
	}
}

// killRounds is the number of SIGKILLs of TestKillDuringDurableAnswers per
// backend: IDENTITYD_KILL_ROUNDS, default 2 (a restart after SIGKILL takes
// about 2.5s); make robustness runs 20.
func killRounds(t *testing.T) int {
	return testproc.CountFromEnv(t, "IDENTITYD_KILL_ROUNDS", 2, 1)
}

// allocRow is what the test reads of identity/allocate -o json.
type allocRow struct {
	Identity struct {
		ID identity.NumericIdentity `json:"id"`
	} `json:"identity"`
}

// TestKillDuringDurableAnswers runs one caller that alternates durable
// ipcache/upsert and identity/allocate answers on one connection, and
// SIGKILLs the agent at a random moment of the loop, again and again on
// the same state directory: after every restart, every pair answered
// before (in any round) must be in the table and the map with its number,
// every label set allocated must get its number again, and no number may
// go to another prefix or label set. With a checkpoint interval of an hour
// only the journals hold the answers.
func TestKillDuringDurableAnswers(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	bin := agentBinary(t)
	rounds := killRounds(t)
	for _, b := range journalBackends() {
		t.Run(b.name, func(t *testing.T) { testKillDuringDurableAnswers(t, bin, b.flags(t), rounds) })
	}
}

func cidrLabels(pfx netip.Prefix) []string {
	return []string{"cidr:" + pfx.String(), "reserved:world"}
}

func testKillDuringDurableAnswers(t *testing.T, bin string, flags []string, rounds int) {
	dir := t.TempDir()
	prefixes := map[netip.Prefix]identity.NumericIdentity{}
	sets := map[netip.Prefix]identity.NumericIdentity{} // allocated label set, by its prefix
	holder := map[identity.NumericIdentity]string{}
	next := 0
	var answers, lostTotal, renumberedTotal int
	var loop []time.Duration
	start := time.Now()
	for round := range rounds + 1 {
		p := startProc(t, bin, dir, flags...)
		if round > 0 {
			lost, renumbered := checkAfterKill(t, p, prefixes, sets, holder)
			lostTotal += len(lost)
			renumberedTotal += len(renumbered)
			if len(lost) > 0 || len(renumbered) > 0 {
				t.Fatalf("round %d: %d answered pairs lost, first %v; %d numbers given to another, first %v\nstatus: %s",
					round, len(lost), lost[:min(5, len(lost))], len(renumbered), renumbered[:min(5, len(renumbered))],
					p.mustShell("identity/restore-status", "-o", "json"))
			}
		}
		if round == rounds {
			p.stop(syscall.SIGTERM)
			break
		}
		u := dialUpserter(t, dir, true)
		done := make(chan struct{})
		go func() {
			defer close(done)
			for {
				i := next
				next++
				if i%2 == 0 {
					pfx := durablePrefix(70+i>>16, i&0xffff)
					id, d, err := u.upsert(pfx)
					if err != nil {
						return
					}
					prefixes[pfx] = id
					holder[id] = pfx.String()
					loop = append(loop, d)
				} else {
					pfx := durablePrefix(140+i>>16, i&0xffff)
					t0 := time.Now()
					out, err := u.sh.Run(t0.Add(time.Minute), append([]string{"identity/allocate", "-o", "json"}, cidrLabels(pfx)...)...)
					if err != nil {
						return
					}
					rows, err := robustness.DecodeList[allocRow](out)
					if err != nil || len(rows) != 1 {
						return
					}
					id := rows[0].Identity.ID
					sets[pfx] = id
					holder[id] = "labels of " + pfx.String()
					loop = append(loop, time.Since(t0))
				}
				answers++
			}
		}()
		// A random moment: the loop is between answers, inside one, or
		// inside a journal write.
		time.Sleep(time.Duration(50+rand.IntN(400)) * time.Millisecond)
		p.stop(syscall.SIGKILL)
		<-done
	}
	t.Logf("%d SIGKILLs during a loop of one caller's durable answers: %d answers, %d lost, %d numbers given to another; answer latency %s; %s in all",
		rounds, answers, lostTotal, renumberedTotal, latencies(loop), time.Since(start).Round(time.Millisecond))
}

// checkAfterKill compares the restarted agent with what was answered.
func checkAfterKill(t *testing.T, p *proc, prefixes, sets map[netip.Prefix]identity.NumericIdentity, holder map[identity.NumericIdentity]string) (lost, renumbered []string) {
	t.Helper()
	table := p.tablePairs()
	inMap := p.mapDump()
	for pfx, id := range prefixes {
		if table[pfx] != id || inMap[pfx] != id {
			lost = append(lost, fmt.Sprintf("%s: answered %d, table %d, map %d", pfx, id, table[pfx], inMap[pfx]))
		}
	}
	for _, m := range []map[netip.Prefix]identity.NumericIdentity{table, inMap} {
		for pfx, id := range m {
			if h, ok := holder[id]; ok && h != pfx.String() {
				renumbered = append(renumbered, fmt.Sprintf("%d: answered for %s, now held by %s", id, h, pfx))
			}
		}
	}
	// Every allocated label set gets its number again: the restored
	// identity holds it until the grace period ends (an hour here).
	if len(sets) > 0 {
		sh, err := robustness.DialShell(filepath.Join(p.dir, "identityd.sock"), 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer sh.Close()
		for pfx, id := range sets {
			out, err := sh.Run(time.Now().Add(time.Minute), append([]string{"identity/allocate", "--no-wait", "-o", "json"}, cidrLabels(pfx)...)...)
			if err != nil {
				t.Fatal(err)
			}
			got, err := robustness.DecodeList[allocRow](out)
			if err != nil || len(got) != 1 {
				t.Fatalf("identity/allocate: %v %q", err, out)
			}
			if got[0].Identity.ID != id {
				lost = append(lost, fmt.Sprintf("labels of %s: answered %d, now %d", pfx, id, got[0].Identity.ID))
			}
			// The extra reference goes again, so that the next round's
			// state is what the loop made.
			if _, err := sh.Run(time.Now().Add(time.Minute), "identity/release", strconv.FormatUint(uint64(id), 10)); err != nil {
				t.Fatal(err)
			}
		}
	}
	slices.Sort(lost)
	slices.Sort(renumbered)
	return lost, slices.Compact(renumbered)
}

// TestDamagedJournalStart damages the journals an agent left at SIGKILL (a
// torn last record, a flipped byte in the middle, a zero-length file, a
// journal of a newer format) and starts an agent on each: it starts, keeps
// a copy of the damaged journal, says so in its log, restores what the
// valid records and the snapshots hold, and answers durably again.
func TestDamagedJournalStart(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	bin := agentBinary(t)
	base := t.TempDir()
	p := startProc(t, bin, base)
	u := dialUpserter(t, base, true)
	answered := map[netip.Prefix]identity.NumericIdentity{}
	const n = 20
	for i := range n {
		pfx := durablePrefix(90, i)
		id, _, err := u.upsert(pfx)
		if err != nil {
			t.Fatal(err)
		}
		answered[pfx] = id
	}
	p.stop(syscall.SIGKILL)
	journals := []string{checkpoint.JournalFileName, ipcachemap.FileName + ipcachemap.JournalSuffix}

	cases := []struct {
		name   string
		damage func([]byte) []byte
		kept   bool
		// least is the number of answered pairs that must be back.
		least int
	}{
		{"torn last record", func(d []byte) []byte { return d[:len(d)-3] }, true, n - 1},
		{"flipped byte in the middle", func(d []byte) []byte {
			d[journal.HeaderSize+(len(d)-journal.HeaderSize)/2] ^= 0x20
			return d
		}, true, 0},
		{"zero-length file", func([]byte) []byte { return nil }, false, 0},
		{"newer format", func(d []byte) []byte {
			// A newer format's header verifies: a changed version
			// alone is a damaged header, whose records are salvaged.
			binary.LittleEndian.PutUint32(d[8:], journal.Version+1)
			binary.LittleEndian.PutUint32(d[28:], crc32.Checksum(d[:28], crc32.MakeTable(crc32.Castagnoli)))
			return d
		}, true, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			copyDir(t, base, dir)
			for _, name := range journals {
				path := filepath.Join(dir, name)
				if err := os.WriteFile(path, tc.damage(mustRead(t, path)), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			q := startProc(t, bin, dir)
			log := q.log.String()
			if tc.kept {
				for _, name := range journals {
					kept, _ := filepath.Glob(filepath.Join(dir, name+".corrupt-*"))
					if len(kept) != 1 {
						t.Errorf("%s: %d copies kept of the damaged journal, want 1", name, len(kept))
					}
				}
				for _, want := range []string{"Identity journal damaged", "map journal " + filepath.Join(dir, ipcachemap.FileName+ipcachemap.JournalSuffix) + " damaged"} {
					if !strings.Contains(log, want) {
						t.Errorf("the log does not say %q:\n%s", want, log)
					}
				}
			}
			inMap := q.mapDump()
			back := 0
			for pfx, id := range answered {
				if inMap[pfx] == id {
					back++
				}
			}
			t.Logf("%s: %d of %d answered pairs restored", tc.name, back, n)
			if back < tc.least {
				t.Errorf("%d of %d answered pairs restored, want at least %d", back, n, tc.least)
			}
			// It answers durably again, after the valid records.
			u := dialUpserter(t, dir, true)
			if _, _, err := u.upsert(durablePrefix(91, 0)); err != nil {
				t.Fatal(err)
			}
			q.stop(syscall.SIGTERM)
		})
	}
}

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// copyDir copies the state files of an agent's state directory (not its
// etcd, which the copy's agent starts afresh).
func copyDir(t *testing.T, from, to string) {
	t.Helper()
	entries, err := os.ReadDir(from)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if !e.Type().IsRegular() {
			continue
		}
		if err := os.WriteFile(filepath.Join(to, e.Name()), mustRead(t, filepath.Join(from, e.Name())), 0o600); err != nil {
			t.Fatal(err)
		}
	}
}
