package restoration_test

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/identityd/identityd/cells/checkpoint"
	"github.com/identityd/identityd/cells/restoration"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/ipcachemap"
)

// damagedMapAgent writes a checkpoint giving prefix i's CIDR label set
// the ID localID(i) and a map giving prefix i the ID mapID(i), then
// starts an agent on them.
func damagedMapAgent(t *testing.T, ps []netip.Prefix, mapID func(int) identity.NumericIdentity) *agent {
	t.Helper()
	dir := t.TempDir()
	ids := make([]*identity.Identity, len(ps))
	entries := make([]ipcachemap.Entry, len(ps))
	for i, p := range ps {
		ids[i] = &identity.Identity{ID: localID(i), Labels: labelsOf(p)}
		entries[i] = ipcachemap.Entry{Key: ipcachemap.Key{Prefix: p}, Value: ipcachemap.Value{Identity: mapID(i)}}
	}
	if err := checkpoint.WriteFile(filepath.Join(dir, checkpoint.FileName), checkpoint.AppendJSON(nil, ids)); err != nil {
		t.Fatal(err)
	}
	writeMap(t, dir, entries)
	a := newAgent(t, dir, time.Hour, nil)
	a.start(t)
	t.Cleanup(func() { a.stop(t) })
	return a
}

func localID(i int) identity.NumericIdentity {
	return identity.NumericIdentity(identity.ScopeLocal) + identity.NumericIdentity(i+1)
}

// checkCheckpointNumbers checks that the map holds restored once the
// ipcache has pruned it, and that no two of its prefixes share an ID; then
// it re-upserts every prefix as its owner would (the prefix alone,
// its CIDR label set) and checks that each answer and the map hold the
// checkpoint's number for the prefix, localID(i).
func checkCheckpointNumbers(t *testing.T, a *agent, ps []netip.Prefix, restored map[netip.Prefix]identity.NumericIdentity) {
	t.Helper()
	got := a.waitMap(t, restored)
	if !equalMaps(got, restored) {
		t.Errorf("map after restoration: %d entries, want %d", len(got), len(restored))
	}
	if dup := sharedIDs(got); len(dup) > 0 {
		t.Errorf("after restoration, prefixes share IDs in the map: %v", dup)
	}
	if err := a.ipc.UpsertBatch(t.Context(), testOwner, updates(ps)); err != nil {
		t.Fatal(err)
	}
	right := 0
	var wrong []string
	want := map[netip.Prefix]identity.NumericIdentity{}
	for i, p := range ps {
		want[p] = localID(i)
		e, ok := a.ipc.LookupPrefix(p)
		if ok && e.Identity == localID(i) {
			right++
		} else if len(wrong) < 5 {
			got := identity.NumericIdentity(0)
			if ok {
				got = e.Identity
			}
			wrong = append(wrong, fmt.Sprintf("%s: %d, want %d", p, got, localID(i)))
		}
	}
	if right != len(ps) {
		t.Errorf("the owner's re-upsert got the checkpoint's number for %d of %d prefixes; e.g. %v", right, len(ps), wrong)
	}
	got = a.waitMap(t, want)
	if !equalMaps(got, want) {
		t.Errorf("map after the owner's re-upsert differs from the checkpoint's numbers (%d entries, want %d)", len(got), len(want))
	}
	if dup := sharedIDs(got); len(dup) > 0 {
		t.Errorf("after the owner's re-upsert, prefixes share IDs in the map: %v", dup)
	}
}

// sharedIDs returns the IDs the map gives more than one prefix.
func sharedIDs(m map[netip.Prefix]identity.NumericIdentity) map[identity.NumericIdentity][]netip.Prefix {
	by := map[identity.NumericIdentity][]netip.Prefix{}
	for p, id := range m {
		by[id] = append(by[id], p)
	}
	for id, ps := range by {
		if len(ps) < 2 {
			delete(by, id)
		}
	}
	return by
}

// TestDamagedMapSharedID: the old map gives a second prefix the local ID
// the checkpoint gives the first prefix's CIDR label set. The checkpoint
// wins: the second entry is skipped and counted, and the owner's re-upsert
// of each prefix gets the checkpoint's number for it.
func TestDamagedMapSharedID(t *testing.T) {
	ps := prefixes(20)
	// Odd prefixes carry the ID of the even one before them.
	a := damagedMapAgent(t, ps, func(i int) identity.NumericIdentity { return localID(i &^ 1) })
	c := a.r.Counters()
	if c.Restored != uint64(len(ps)) || c.MapEntriesSharedID != uint64(len(ps)/2) || c.MapEntriesOtherLabels != 0 ||
		c.PrefixesRestored != uint64(len(ps)/2) {
		t.Errorf("counters: %+v", c)
	}
	restored := map[netip.Prefix]identity.NumericIdentity{}
	for i, p := range ps {
		if i%2 == 0 {
			restored[p] = localID(i)
		}
		e, ok := a.ipc.LookupPrefix(p)
		switch {
		case i%2 == 0 && (!ok || e.Identity != localID(i)):
			t.Errorf("%s: restored as %v, want %d", p, e, localID(i))
		case i%2 == 1 && ok:
			t.Errorf("%s: restored as %d, which the checkpoint gives %s", p, e.Identity, ps[i-1])
		}
	}
	checkCheckpointNumbers(t, a, ps, restored)
}

// TestDamagedMapRotatedIDs: the old map's IDs are a permutation of the
// checkpoint's (prefix i has the ID of prefix i+1). Every entry
// contradicts the checkpoint and is skipped; the owner's re-upsert gets
// the checkpoint's number for all 200 prefixes.
func TestDamagedMapRotatedIDs(t *testing.T) {
	ps := prefixes(200)
	a := damagedMapAgent(t, ps, func(i int) identity.NumericIdentity { return localID((i + 1) % len(ps)) })
	c := a.r.Counters()
	if c.Restored != uint64(len(ps)) || c.MapEntriesOtherLabels != uint64(len(ps)) || c.MapEntriesSharedID != 0 ||
		c.PrefixesRestored != 0 {
		t.Errorf("counters: %+v", c)
	}
	if st := a.r.Status(); st.State != restoration.StateHolding || st.HeldIdentities != len(ps) {
		t.Errorf("status: %+v", st)
	}
	// identity/restore-status -o json shows the counters.
	js, err := json.Marshal(a.r.Status())
	if err != nil || !strings.Contains(string(js), `"map-entries-other-labels":200`) || !strings.Contains(string(js), `"map-entries-shared-id":0`) {
		t.Errorf("status JSON: %s, %v", js, err)
	}
	if n := len(a.ipc.ListOwner(restoration.Owner)); n != 0 {
		t.Errorf("restoration contributes %d prefixes, want 0", n)
	}
	checkCheckpointNumbers(t, a, ps, nil)
}
