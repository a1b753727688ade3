package restarttest

import (
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/identityd/identityd/cells/checkpoint"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/ipcachemap"
	"github.com/identityd/identityd/internal/journal"
	"github.com/identityd/identityd/internal/robustness"
)

// damageKind is one kind of damage TestDamageNeverReassigns does to the
// files a SIGKILLed agent left.
type damageKind struct {
	name string
	// journal damages a journal's bytes; nil leaves the journals alone.
	journal func([]byte) []byte
	// mapJournal: the file backend's map journal is damaged too (or
	// alone, with identityJournal false).
	mapJournal, identityJournal bool
	// olderCheckpoint puts back the checkpoint of the round's start;
	// noCheckpoint removes it; olderMap puts back the map file of the
	// round's start (file backend).
	olderCheckpoint, noCheckpoint, olderMap bool
	// restartMidRound stops the agent cleanly (SIGTERM) halfway through
	// the round and starts it again, instead of writing the checkpoint:
	// the second half is answered by a start that restored the first.
	restartMidRound bool
	// maxLost bounds the answered pairs of the round that may be missing
	// from the table and the map after the restart: those whose only
	// records were damaged. maxLostSets bounds the label sets allocated
	// in the round (identity/allocate, in no map) that do not get their
	// number again; -1: any number, as the only file naming them is gone.
	maxLost, maxLostSets int
}

// journalMiddle is the offset of the middle of a journal's records.
func journalMiddle(d []byte) int {
	return journal.HeaderSize + (len(d)-journal.HeaderSize)/2
}

func damageKinds() []damageKind {
	return []damageKind{
		{name: "flip", journal: func(d []byte) []byte { d[journalMiddle(d)] ^= 0x20; return d }, identityJournal: true, mapJournal: true, maxLost: 1, maxLostSets: 1},
		{name: "cut", journal: func(d []byte) []byte {
			m := journalMiddle(d)
			return append(d[:m-10], d[m+25:]...)
		}, identityJournal: true, mapJournal: true, maxLost: 2, maxLostSets: 2},
		{name: "garbage", journal: func(d []byte) []byte {
			m := journalMiddle(d)
			for i := m - 8; i < m+30; i++ {
				d[i] = byte(i*37 + 11)
			}
			return d
		}, identityJournal: true, mapJournal: true, maxLost: 2, maxLostSets: 2},
		// The label sets allocated after the checkpoint write are named
		// by no file any more.
		{name: "zero length", journal: func([]byte) []byte { return nil }, identityJournal: true, maxLostSets: damageRound / 2},
		{name: "header", journal: func(d []byte) []byte { d[18] ^= 0x40; return d }, identityJournal: true, mapJournal: true},
		// The label sets only the checkpoint named are gone with it.
		{name: "checkpoint older", olderCheckpoint: true, maxLostSets: -1},
		{name: "checkpoint deleted", noCheckpoint: true, maxLostSets: -1},
		{name: "both older", olderCheckpoint: true, olderMap: true, maxLostSets: -1},
		// The checkpoint of a clean restart lost: the restarted agent's
		// answers are named by its journal alone, the numbers of the
		// earlier answers by no file.
		{name: "checkpoint older after a restart", olderCheckpoint: true, restartMidRound: true, maxLostSets: -1},
		{name: "checkpoint deleted after a restart", noCheckpoint: true, restartMidRound: true, maxLostSets: -1},
		// The map journal alone emptied (file backend): the map loses
		// the round's entries, which nothing else holds; the identities
		// keep their numbers.
		{name: "zero length map journal", journal: func([]byte) []byte { return nil }, mapJournal: true, maxLost: damageRound},
	}
}

// damageRound is the number of prefixes upserted, and of label sets
// allocated, in each round: half before a checkpoint write, half after
// it (in the journals only).
const damageRound = 16

// TestDamageNeverReassigns damages the files a SIGKILLed agent left, one
// kind of damage per round of one agent-restart loop, on both backends:
// a flipped byte, a cut, an overwritten range, a zero-length file and a
// damaged header in the journals, a checkpoint older than its journal,
// deleted, or older together with the map file, and the map journal
// alone emptied. Each round answers upserts (whose numbers the datapath
// map holds too) and allocations of label sets no map holds. After each
// restart no number answered in any round belongs to another prefix or
// label set while the grace period lasts (new prefixes and label sets get
// none of them), every answer whose records verify is back with its
// number, and identity/restore-status and the log name the damage and the
// copy kept.
func TestDamageNeverReassigns(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	bin := agentBinary(t)
	for _, b := range journalBackends() {
		t.Run(b.name, func(t *testing.T) { testDamageNeverReassigns(t, bin, b.name, b.flags(t)) })
	}
}

// allocate allocates the label set of pfx (identity/allocate, waiting
// for the durability point) and returns its number.
func allocate(t *testing.T, sh *robustness.Shell, pfx netip.Prefix) identity.NumericIdentity {
	t.Helper()
	out, err := sh.Run(time.Now().Add(time.Minute), append([]string{"identity/allocate", "-o", "json"}, cidrLabels(pfx)...)...)
	if err != nil {
		t.Fatal(err)
	}
	rows, err := robustness.DecodeList[allocRow](out)
	if err != nil || len(rows) != 1 {
		t.Fatalf("identity/allocate: %v %q", err, out)
	}
	return rows[0].Identity.ID
}

func testDamageNeverReassigns(t *testing.T, bin, backend string, flags []string) {
	dir := t.TempDir()
	holder := map[identity.NumericIdentity]string{}
	sets := map[netip.Prefix]identity.NumericIdentity{} // allocated label sets, by their prefix
	cpPath := filepath.Join(dir, checkpoint.FileName)
	mapPath := filepath.Join(dir, ipcachemap.FileName)
	start := time.Now()
	p := startProc(t, bin, dir, flags...)
	series := 0
	for _, kind := range damageKinds() {
		if kind.mapJournal && !kind.identityJournal && backend != "file" {
			continue
		}
		series++
		olderCp, cpErr := os.ReadFile(cpPath)
		olderMap, mapErr := os.ReadFile(mapPath)
		u := dialUpserter(t, dir, true)
		round := map[netip.Prefix]identity.NumericIdentity{}
		roundSets := map[netip.Prefix]bool{}
		for i := range damageRound {
			switch {
			case i == damageRound/2 && kind.restartMidRound:
				p.stop(syscall.SIGTERM)
				p = startProc(t, bin, dir, flags...)
				u = dialUpserter(t, dir, true)
			case i == damageRound/2:
				p.mustShell("checkpoint/write")
			}
			pfx := durablePrefix(150+series, i)
			id, _, err := u.upsert(pfx)
			if err != nil {
				t.Fatal(err)
			}
			round[pfx], holder[id] = id, pfx.String()
			set := durablePrefix(170+series, i)
			id = allocate(t, u.sh, set)
			sets[set], holder[id], roundSets[set] = id, "labels of "+set.String(), true
		}
		p.stop(syscall.SIGKILL)

		damage := func(name string) {
			path := filepath.Join(dir, name)
			data, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("%s: %v", kind.name, err)
			}
			if err := os.WriteFile(path, kind.journal(data), 0o600); err != nil {
				t.Fatal(err)
			}
		}
		if kind.journal != nil && kind.identityJournal {
			damage(checkpoint.JournalFileName)
		}
		if kind.journal != nil && kind.mapJournal && backend == "file" {
			damage(ipcachemap.FileName + ipcachemap.JournalSuffix)
		}
		switch {
		case kind.noCheckpoint || (kind.olderCheckpoint && errors.Is(cpErr, fs.ErrNotExist)):
			if err := os.Remove(cpPath); err != nil {
				t.Fatal(err)
			}
		case kind.olderCheckpoint:
			if err := checkpoint.WriteFile(cpPath, olderCp); err != nil {
				t.Fatal(err)
			}
		}
		if kind.olderMap && backend == "file" && mapErr == nil {
			if err := os.WriteFile(mapPath, olderMap, 0o600); err != nil {
				t.Fatal(err)
			}
		}

		q := startProc(t, bin, dir, flags...)
		status := q.mustShell("identity/restore-status", "-o", "json")
		table := q.tablePairs()
		inMap := q.mapDump()
		u = dialUpserter(t, dir, true)
		var reassigned []string
		check := func(id identity.NumericIdentity, now string) {
			if h, ok := holder[id]; ok && h != now {
				reassigned = append(reassigned, fmt.Sprintf("%d: answered for %s, now held by %s", id, h, now))
			}
		}
		// Every label set allocated so far gets its number again, or
		// (its records gone) a number answered to nobody else. The
		// reference taken stays: it is an answer like the first.
		lostSets := 0
		renumbered := map[netip.Prefix]identity.NumericIdentity{}
		for set, id := range sets {
			got := allocate(t, u.sh, set)
			check(got, "labels of "+set.String())
			if got != id {
				renumbered[set] = got
				if roundSets[set] {
					lostSets++
				}
			}
		}
		// New prefixes and label sets while the grace period lasts.
		for i := range damageRound / 2 {
			pfx := durablePrefix(200+series, i)
			id, _, err := u.upsert(pfx)
			if err != nil {
				t.Fatal(err)
			}
			check(id, pfx.String())
			set := durablePrefix(220+series, i)
			check(allocate(t, u.sh, set), "labels of "+set.String())
		}
		for _, m := range []map[netip.Prefix]identity.NumericIdentity{table, inMap} {
			for pfx, id := range m {
				check(id, pfx.String())
			}
		}
		// A lost label set's old number is withheld for this restart's
		// grace period only: no later start knows it. Its new number
		// is its answer from now on.
		for set, got := range renumbered {
			delete(holder, sets[set])
			sets[set], holder[got] = got, "labels of "+set.String()
		}
		lost := 0
		for pfx, id := range round {
			if table[pfx] != id || inMap[pfx] != id {
				lost++
			}
		}
		t.Logf("%s, %s: %d of %d answered pairs and %d of %d label sets of the round back, %d numbers of any round given to another prefix or label set",
			backend, kind.name, len(round)-lost, len(round), len(roundSets)-lostSets, len(roundSets), len(reassigned))
		if len(reassigned) > 0 {
			t.Errorf("%s: answered numbers given to another prefix: %v\nstatus: %s\nlog:\n%s", kind.name, reassigned, status, q.log)
		}
		if kind.maxLostSets >= 0 && lostSets > kind.maxLostSets {
			t.Errorf("%s: %d label sets of the round did not get their number again, at most %d may not\nstatus: %s\nlog:\n%s", kind.name, lostSets, kind.maxLostSets, status, q.log)
		}
		if lost > kind.maxLost {
			t.Errorf("%s: %d answered pairs of the round lost, at most %d may be\nstatus: %s\nlog:\n%s", kind.name, lost, kind.maxLost, status, q.log)
		}
		// The report names what was set aside.
		log := q.log.String()
		if kind.identityJournal || kind.olderCheckpoint || kind.noCheckpoint {
			if !strings.Contains(status, `"journal-damage"`) {
				t.Errorf("%s: restore-status does not report the journal's damage: %s", kind.name, status)
			}
			if kind.name != "zero length" && !strings.Contains(status, `"kept-as"`) {
				t.Errorf("%s: restore-status does not name the copy kept: %s", kind.name, status)
			}
		}
		if kind.mapJournal && backend == "file" && !strings.Contains(log, "map journal") {
			t.Errorf("%s: the log does not report the map journal's damage:\n%s", kind.name, log)
		}
		if kind.mapJournal && backend == "file" && !strings.Contains(status, `"map-journal-damage"`) {
			t.Errorf("%s: restore-status does not report the map journal's damage: %s", kind.name, status)
		}
		p = q
	}
	p.stop(syscall.SIGTERM)
	t.Logf("%s: %d rounds in %v", backend, series, time.Since(start).Round(time.Millisecond))
}

// TestUnusableJournalRefusesStart: an identity journal that cannot be
// opened (a directory in its place; an immutable file, where chattr works)
// refuses the start: the agent exits non-zero with one line naming the
// journal, instead of turning ready and failing every durable answer.
func TestUnusableJournalRefusesStart(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	bin := agentBinary(t)
	cases := []struct {
		name    string
		prepare func(t *testing.T, path string)
	}{
		{"directory", func(t *testing.T, path string) {
			if err := os.Mkdir(path, 0o700); err != nil {
				t.Fatal(err)
			}
		}},
		{"immutable", func(t *testing.T, path string) {
			if err := os.WriteFile(path, journal.Header(1, journal.Base{}), 0o600); err != nil {
				t.Fatal(err)
			}
			if out, err := exec.Command("chattr", "+i", path).CombinedOutput(); err != nil {
				t.Skipf("chattr +i: %v %s", err, out)
			}
			t.Cleanup(func() { exec.Command("chattr", "-i", path).Run() })
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, checkpoint.JournalFileName)
			tc.prepare(t, path)
			cmd := exec.Command(bin, "--state-dir", dir, "--ipcache-map=file", "--prometheus-serve-addr=127.0.0.1:0")
			var out lockedBuffer
			cmd.Stdout, cmd.Stderr = &out, &out
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- cmd.Wait() }()
			select {
			case err := <-done:
				if err == nil {
					t.Fatalf("the agent exited 0\n%s", out.String())
				}
			case <-time.After(time.Minute):
				cmd.Process.Kill()
				<-done
				t.Fatalf("the agent started with an unusable identity journal\n%s", out.String())
			}
			var lines []string
			for _, l := range strings.Split(out.String(), "\n") {
				if strings.Contains(l, "identity journal unusable") && strings.Contains(l, path) {
					lines = append(lines, l)
				}
			}
			t.Logf("%s: %q", tc.name, lines)
			if len(lines) == 0 {
				t.Fatalf("no line names the unusable journal:\n%s", out.String())
			}
		})
	}
}
