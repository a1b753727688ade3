package checkpoint_test

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/checkpoint"
	"github.com/identityd/identityd/cells/statedir"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/testhive"
	"github.com/identityd/identityd/labels"
)

// newHive composes the cells the checkpoint runs with. extra cells come
// first, so that a user of the allocator is constructed before the
// checkpoint cell would be by list order.
func newHive(t *testing.T, dir string, interval time.Duration, extra ...cell.Cell) (*hive.Hive, *checkpoint.Checkpoint, allocator.Allocator) {
	t.Helper()
	var (
		cp    *checkpoint.Checkpoint
		alloc allocator.Allocator
	)
	cells := append(slices.Clone(extra),
		cell.SimpleHealthCell, job.Cell, statedb.Cell, allocator.Cell, statedir.Cell, checkpoint.Cell,
		cell.Invoke(func(c *checkpoint.Checkpoint, a allocator.Allocator) { cp, alloc = c, a }),
	)
	h := hive.New(cells...)
	hive.AddConfigOverride(h, func(c *statedir.Config) { c.StateDir = dir })
	hive.AddConfigOverride(h, func(c *checkpoint.Config) { c.IdentityCheckpointInterval = interval })
	if err := h.Populate(hivetest.Logger(t)); err != nil {
		t.Fatal(err)
	}
	return h, cp, alloc
}

func cidr(s string) labels.Labels { return labels.FromPrefix(netip.MustParsePrefix(s), false) }

// fileIdentities returns the checkpoint's identities as "id labels" strings.
func fileIdentities(t *testing.T, dir string) map[identity.NumericIdentity]string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, checkpoint.FileName))
	if err != nil {
		t.Fatal(err)
	}
	ids, invalid, err := checkpoint.Decode(data)
	if err != nil || len(invalid) > 0 {
		t.Fatalf("decode: %v %v", err, invalid)
	}
	out := map[identity.NumericIdentity]string{}
	for _, id := range ids {
		out[id.ID] = id.Labels.String()
	}
	return out
}

func TestFinalWriteOnStop(t *testing.T) {
	dir := t.TempDir()
	h, cp, alloc := newHive(t, dir, time.Hour)
	running := testhive.Start(t, h)
	id, _, err := alloc.Allocate(t.Context(), cidr("10.1.0.0/16"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, checkpoint.FileName)); err == nil {
		t.Fatal("checkpoint written before the interval elapsed")
	}
	running.Stop()
	got := fileIdentities(t, dir)
	if got[id.ID] != id.Labels.String() || len(got) != 1 {
		t.Fatalf("final checkpoint holds %v, want %d %s", got, id.ID, id.Labels)
	}
	if st := cp.Status(); st.Entries != 1 || st.Counters.Writes != 1 || st.LastError != nil {
		t.Fatalf("status %+v", st)
	}
	fi, err := os.Stat(filepath.Join(dir, checkpoint.FileName))
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("file mode %v, %v", fi.Mode(), err)
	}
}

// TestHookOrder checks that the changes a user of the allocator makes in
// its own stop hook are in the final checkpoint, even though the user is
// listed (and so constructed) before the checkpoint cell, except that an
// identity released there keeps its place: the next start restores it.
func TestHookOrder(t *testing.T) {
	dir := t.TempDir()
	var early, late *identity.Identity
	user := cell.Invoke(func(lc cell.Lifecycle, a allocator.Allocator) {
		lc.Append(cell.Hook{
			OnStart: func(ctx cell.HookContext) (err error) {
				early, _, err = a.Allocate(ctx, cidr("10.2.0.0/16"))
				return err
			},
			OnStop: func(ctx cell.HookContext) (err error) {
				if _, err := a.Release(ctx, early); err != nil {
					return err
				}
				late, _, err = a.Allocate(ctx, cidr("10.3.0.0/16"))
				return err
			},
		})
	})
	h, _, _ := newHive(t, dir, time.Hour, user)
	running := testhive.Start(t, h)
	running.Stop()
	got := fileIdentities(t, dir)
	if got[early.ID] != early.Labels.String() {
		t.Errorf("identity %d released in a stop hook is not kept in the checkpoint: %v", early.ID, got)
	}
	if got[late.ID] != late.Labels.String() || len(got) != 2 {
		t.Errorf("checkpoint holds %v, want %d %s allocated in a stop hook besides %d", got, late.ID, late.Labels, early.ID)
	}
}

// TestReleasesInStopHooksKeepNumbers runs a user of the allocator that
// releases all its local identities in its stop hook, as an agent that
// cleans up on the way down does: the final checkpoint still holds them,
// so the next start gives them their numbers back. A label set allocated
// again under another number during the stop is kept only under that one.
func TestReleasesInStopHooksKeepNumbers(t *testing.T) {
	dir := t.TempDir()
	var held []*identity.Identity
	var again *identity.Identity
	user := cell.Invoke(func(lc cell.Lifecycle, a allocator.Allocator) {
		lc.Append(cell.Hook{
			OnStart: func(ctx cell.HookContext) error {
				for i := range 20 {
					id, _, err := a.Allocate(ctx, cidr(fmt.Sprintf("10.%d.0.0/16", i)))
					if err != nil {
						return err
					}
					held = append(held, id)
				}
				return nil
			},
			OnStop: func(ctx cell.HookContext) (err error) {
				for _, id := range held {
					if _, err := a.Release(ctx, id); err != nil {
						return err
					}
				}
				// The first label set comes back under a new number.
				again, _, err = a.Allocate(ctx, held[0].Labels)
				return err
			},
		})
	})
	h, _, _ := newHive(t, dir, time.Hour, user)
	running := testhive.Start(t, h)
	running.Stop()
	got := fileIdentities(t, dir)
	if again.ID == held[0].ID {
		t.Fatalf("the label set released and allocated again kept its number %d; the test needs a new one", again.ID)
	}
	if got[again.ID] != again.Labels.String() {
		t.Errorf("the identity allocated in the stop hook is missing: %v", got)
	}
	if _, ok := got[held[0].ID]; ok {
		t.Errorf("label set %s is in the checkpoint under two numbers: %v", held[0].Labels, got)
	}
	for _, id := range held[1:] {
		if got[id.ID] != id.Labels.String() {
			t.Errorf("identity %d %s released in the stop hook is not in the final checkpoint", id.ID, id.Labels)
		}
	}
	if len(got) != len(held) {
		t.Errorf("checkpoint holds %d identities, want %d", len(got), len(held))
	}

	// The next start, with the same user, gets the numbers back.
	var restored []*identity.Identity
	loader := cell.Invoke(func(lc cell.Lifecycle, c *checkpoint.Checkpoint, a allocator.Allocator) {
		lc.Append(cell.Hook{OnStart: func(ctx cell.HookContext) error {
			res, err := c.Load()
			if err != nil {
				return err
			}
			reqs := make([]allocator.Request, len(res.Identities))
			for i, id := range res.Identities {
				reqs[i] = allocator.Request{Labels: id.Labels, OldID: id.ID, Restored: true}
			}
			for _, r := range a.AllocateBatch(ctx, reqs) {
				if r.Err != nil {
					return r.Err
				}
			}
			for _, id := range held[1:] {
				got, _, err := a.Allocate(ctx, id.Labels)
				if err != nil {
					return err
				}
				restored = append(restored, got)
			}
			return nil
		}})
	})
	h2, _, _ := newHive(t, dir, time.Hour, loader)
	testhive.Start(t, h2)
	for i, id := range held[1:] {
		if restored[i].ID != id.ID {
			t.Errorf("%s got %d after the restart, had %d", id.Labels, restored[i].ID, id.ID)
		}
	}
}

func TestTriggeredWrites(t *testing.T) {
	dir := t.TempDir()
	h, cp, alloc := newHive(t, dir, 0)
	testhive.Start(t, h)

	waitFor := func(what string, cond func(map[identity.NumericIdentity]string) bool) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for {
			data, err := os.ReadFile(filepath.Join(dir, checkpoint.FileName))
			if err == nil {
				if ids, _, err := checkpoint.Decode(data); err == nil {
					m := map[identity.NumericIdentity]string{}
					for _, id := range ids {
						m[id.ID] = id.Labels.String()
					}
					if cond(m) {
						return
					}
				}
			}
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s", what)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	id, _, err := alloc.Allocate(t.Context(), cidr("10.4.0.0/16"))
	if err != nil {
		t.Fatal(err)
	}
	waitFor("allocation", func(m map[identity.NumericIdentity]string) bool { return m[id.ID] != "" })
	// A second reference is no change of the local identities.
	if _, _, err := alloc.Allocate(t.Context(), cidr("10.4.0.0/16")); err != nil {
		t.Fatal(err)
	}
	alloc.Release(t.Context(), id)
	alloc.Release(t.Context(), id)
	waitFor("release", func(m map[identity.NumericIdentity]string) bool { return len(m) == 0 })
	if st := cp.Status(); st.Counters.Writes < 2 || st.LastError != nil {
		t.Fatalf("status %+v", st)
	}
}

func TestCoalescedWrites(t *testing.T) {
	dir := t.TempDir()
	h, cp, alloc := newHive(t, dir, 300*time.Millisecond)
	running := testhive.Start(t, h)
	for i := range 50 {
		if _, _, err := alloc.Allocate(t.Context(), cidr(netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 5, byte(i), 0}), 24).String())); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(700 * time.Millisecond)
	writes := cp.Status().Counters.Writes
	if writes < 1 || writes > 3 {
		t.Errorf("%d writes for 50 changes within 700ms at an interval of 300ms", writes)
	}
	running.Stop()
	if got := fileIdentities(t, dir); len(got) != 50 {
		t.Errorf("checkpoint holds %d identities, want 50", len(got))
	}
}

// TestNoChangeKeepsFile checks that a run without any local change, such
// as one that failed before restoration, does not replace the checkpoint.
func TestNoChangeKeepsFile(t *testing.T) {
	dir := t.TempDir()
	old := []byte(`[{"id":16777217,"labels":{"10.0.0.0/8":{"key":"10.0.0.0/8","source":"cidr"},"world":{"key":"world","source":"reserved"}}}]` + "\n")
	if err := os.WriteFile(filepath.Join(dir, checkpoint.FileName), old, 0o600); err != nil {
		t.Fatal(err)
	}
	h, _, _ := newHive(t, dir, 0)
	running := testhive.Start(t, h)
	running.Stop()
	data, _ := os.ReadFile(filepath.Join(dir, checkpoint.FileName))
	if string(data) != string(old) {
		t.Fatalf("checkpoint replaced: %s", data)
	}
}

// TestCorruptFileAgentStarts loads a corrupt checkpoint the way the
// restoration cell does, in a start hook: the agent starts, the file is
// kept aside, and the checkpoint is written afresh.
func TestCorruptFileAgentStarts(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, checkpoint.FileName)
	corrupt := []byte(`[{"id":16777217,"labels":{"10.0.0.0/8":{"key":"10.0.`)
	if err := os.WriteFile(path, corrupt, 0o600); err != nil {
		t.Fatal(err)
	}
	var rep checkpoint.Report
	restore := cell.Invoke(func(lc cell.Lifecycle, cp *checkpoint.Checkpoint) {
		lc.Append(cell.Hook{OnStart: func(cell.HookContext) error {
			res, err := cp.Load()
			rep = res.Report
			return err
		}})
	})
	h, cp, alloc := newHive(t, dir, time.Hour, restore)
	running := testhive.Start(t, h)
	if rep.Corrupt == nil || rep.SetAside == "" || rep.Valid != 0 {
		t.Fatalf("report %+v", rep)
	}
	kept, err := os.ReadFile(rep.SetAside)
	if err != nil || string(kept) != string(corrupt) {
		t.Fatalf("set-aside file: %q, %v", kept, err)
	}
	if _, _, err := alloc.Allocate(t.Context(), cidr("10.6.0.0/16")); err != nil {
		t.Fatal(err)
	}
	running.Stop()
	if got := fileIdentities(t, dir); len(got) != 1 {
		t.Fatalf("checkpoint holds %v", got)
	}
	if c := cp.Status().Counters; c.CorruptFiles != 1 || c.Loads != 1 {
		t.Fatalf("counters %+v", c)
	}
}
